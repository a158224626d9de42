"""ONNX Runtime sessions, CPU stand-ins for CUDA-only ops, session hints, ORT version compat, custom ops."""
