"""readfence: exact, provably sound fences for shared buffers read during CUDA-graph replay."""

__version__ = "0.1.0"
