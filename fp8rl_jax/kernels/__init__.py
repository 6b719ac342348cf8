"""Hand-written accelerator kernels (Pallas), each beside a pure-JAX path with the same signature."""
