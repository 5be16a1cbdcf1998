"""Wire protocol, endpoints (dispatch/combine) and transports (loopback, shm) between attention and FFN ranks."""
