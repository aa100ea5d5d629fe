"""Device meshes, logical-axis sharding rules, sharded init and multi-host start-up."""
