"""Taps that survive CUDA-graph replay. A leaf package: it imports torch, numpy and nnsight, vLLM and Triton only
where it runs on them, and never the application that drives it (a vLLM worker imports this package alone).

`VLLMInterleaver` serves nnsight traces and compiled edit programs at declared taps; `EditBank` and `StepRows`
map each step's flat token rows to the requests that own them and the edits (`StageEdit`) they carry.
"""

from interleaver.bank import EditBank, RequestEdits
from interleaver.rows import Span, StepRows
from interleaver.interleaver import VLLMInterleaver
from interleaver.program import TapProgram
from interleaver.stage import Kind, Rows, StageEdit

__all__ = ["EditBank", "Kind", "RequestEdits", "Rows", "Span", "StageEdit", "StepRows", "TapProgram",
           "VLLMInterleaver"]
