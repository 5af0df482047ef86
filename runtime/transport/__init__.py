"""Coordinator <-> rank transport: ZeroMQ with versioned msgpack schemas
(built with the ranks/transport issue)."""
