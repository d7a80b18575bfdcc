"""The scheduler process: block manager, waiting/running queues and the continuous-batching step loop. Imports no torch."""
