"""Scale-out with JAX's own machinery: the device mesh from ``config.mesh`` (``mesh``), logical-axis sharding rules
over the state's key paths (``rules``), and the model and train state created on the mesh (``state``)."""
