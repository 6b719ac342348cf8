"""Hand-written accelerator kernels (Pallas, and one library call through an XLA FFI handler: cublaslt), each beside a
pure-JAX path with the same signature."""
