"""sluiceway: glue shared by the router, scheduler and worker processes (config, logging, CLI, client)."""
