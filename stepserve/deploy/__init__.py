"""Exporters: ONNX folders, TensorRT engine plans and Triton model repositories. Used by `stepserve export`;
the engine never imports this package."""
