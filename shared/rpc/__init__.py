"""gRPC plumbing shared by every role: server construction (health, reflection, auth, TLS, metrics, drain),
request validation, structured logging and the Python client."""
