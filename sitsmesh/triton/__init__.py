"""Run and talk to a real Triton Inference Server (the nvidia-pytriton wheel's tritonserver)."""
