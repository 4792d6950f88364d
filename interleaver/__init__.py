"""Taps that survive CUDA-graph replay (see ../shared/seed/interleaver.txt for the contract).

`VLLMInterleaver` serves nnsight traces and compiled edit programs at declared taps; `EditBank` and `StepRows`
map each step's flat token rows to the requests that own them and the edits they carry.
"""

from interleaver.bank import EditBank, RequestEdits, Span, StepRows
from interleaver.interleaver import VLLMInterleaver
from interleaver.program import TapProgram

__all__ = ["EditBank", "RequestEdits", "Span", "StepRows", "TapProgram", "VLLMInterleaver"]
