"""gRPC protocol definitions (pdllm.v1) and the Python stubs generated from them."""
