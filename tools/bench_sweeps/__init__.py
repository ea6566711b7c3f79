"""The sections of tools/bench.py (the command line: its docstring is the bench's description, its
flags, and which mode runs), one module per sweep family.

One tool split over files, not library code: only tools/bench.py imports this package (and the
tests, through that script: tests/test_bench.py). Its modules import the package and each other,
never another tool; the reference they compare against lives in the package
(megatron_longstraw/models/reference.py).

    common.py          one point in a fresh child under the RSS watchdog (run_point), the cap
                       tests (exceeds_cap, fits_cap, sweep_until_over), the table helpers
    child.py           the point itself, in the child (`bench.py --one`): LongStraw, LongStraw
                       exact, conventional GRPO, the no-grad forward, measured
    predicted.py       the default mode (--quick, --points): largest P predicted from growth;
                       bench.{md,json}, bench_memory.png
    prompt_sweep.py    the measured largest-P table (--sweep): bench-sweep.{md,json}
    response_sweep.py  the measured largest-R table (--response-sweep): bench-response.{md,json}
"""
