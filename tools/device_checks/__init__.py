"""The sections of tools/device_check.py (the driver: arguments, section order, time budget).

One tool split over files, not library code: only tools/device_check.py imports this package (and
the tests that run its sections on CPU, through that script: tests/test_kernels.py). Its modules
import the package and each other, never another tool; what is reusable lives in the package
(the backend-vs-reference checks in megatron_longstraw/kernels/parity.py, the step in
step/schedule.py, the planner). RESULTS is the one report of a device_check.py run.

    common.py       RESULTS (what --json writes) and the report helpers: say, run_section, check,
                    median_ms
    environment.py  1. torch, CUDA, GPU, flash-linear-attention, kernel backends
    kernels.py      2. Triton sparse MLA in the CPU interpreter; 3 + 4. GPU parity and timing of
                    sparse MLA, the indexer, TransformerEngine and apex
    gdn.py          5. Qwen3.6 Gated DeltaNet kernel parity and timing
    sweep.py        building a model on the GPU and the prompt-length sweep of the model steps
    steps.py        6 + 7. one LongStraw step of GLM-5.2 and of Qwen3.6
    capacity.py     8. streamed capture at P and 2P: measured device peak beside the planner's
"""
