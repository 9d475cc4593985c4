"""Steps made of several lowered graphs: speculative step shapes and per-stream groups.

A step shape (``eagle``, ``multi_eagle``, ``ngram``) runs its phases one after another on one
forward stream, and each buffer's fence comes from the phase holding its last read; a
``per_stream`` group lowers one member per forward stream. ``lower_step`` lowers any of a
backend, a group or a shape; ``lower_capture_list`` one for every batch size of a capture list.
"""

from ._capture import CaptureList, capture_list, lower_capture_list
from ._composite import JoinedFence, PhasedStep, StreamGroup
from ._shapes import STEP_SHAPES, Phase, StepShape, eagle, multi_eagle, ngram, parse_step, parse_target
from ._target import LoweredStep, Target, lower_step

__all__ = [
    "STEP_SHAPES",
    "CaptureList",
    "JoinedFence",
    "LoweredStep",
    "Phase",
    "PhasedStep",
    "StepShape",
    "StreamGroup",
    "Target",
    "capture_list",
    "eagle",
    "lower_capture_list",
    "lower_step",
    "multi_eagle",
    "ngram",
    "parse_step",
    "parse_target",
]
