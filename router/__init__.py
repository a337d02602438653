"""Router: public gRPC front door; discovers workers and routes prefill/decode work."""
