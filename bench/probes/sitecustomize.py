"""A probe of the train step in every process of a run, Ray actors included (issue #15): with TRAIN_PROF=DIR and
this directory first on PYTHONPATH (Python imports `sitecustomize` at start-up, Ray's workers inherit the variable),
each process that imports rl.runtime.worker times every `PolicyWorker.train_step` inside itself (device-synced: rows,
tokens, longest row, thread, torch threads, CUDA memory; DIR/steps_<pid>.txt) and profiles its 4th GRPO step
(PROF_AT=N for another; torch.profiler's table, DIR/prof_GRPOStage_<pid>.txt). The profiled step is slower.

    TRAIN_PROF=/tmp/tp PYTHONPATH=bench/probes:$PYTHONPATH python bench/async_dispatch.py ... --actor-vs-inprocess

Nothing happens without TRAIN_PROF; rl.runtime.worker is patched when first imported, so other processes import nothing.
"""

import os
import time

def _patch(W):
    try:
        import torch

        _orig = W.PolicyWorker.train_step

        def train_step(self, batch, stage):
            self._np = getattr(self, "_np", 0) + 1
            kind = type(stage).__name__
            self._nk = getattr(self, "_nk", {})
            self._nk[kind] = self._nk.get(kind, 0) + 1
            out_dir = os.environ["TRAIN_PROF"]
            rows = batch if isinstance(batch, list) else [batch]
            lens = [len(p) + len(r) for b in rows for p, r in zip(b.prompts_B, b.responses_B)]
            rt = [getattr(x, "dtype", None) for b in rows for x in (b.routing_B or [])[:1]]
            torch.cuda.is_available() and torch.cuda.synchronize()
            t = time.perf_counter()
            prof = None
            if self._nk[kind] == int(os.environ.get("PROF_AT", "4")) and kind != "SFTStage":
                from torch.profiler import ProfilerActivity, profile
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                prof.__enter__()
            r = _orig(self, batch, stage)
            torch.cuda.is_available() and torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if prof is not None:
                prof.__exit__(None, None, None)
                with open(f"{out_dir}/prof_{kind}_{os.getpid()}.txt", "w") as f:
                    f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
            import threading
            with open(f"{out_dir}/steps_{os.getpid()}.txt", "a") as f:
                f.write(f"{kind} step {self._nk[kind]} {dt:.3f}s rows {len(lens)} tokens {sum(lens)} max {max(lens)} routing {rt} "
                        f"thread {threading.current_thread().name} omp {os.environ.get('OMP_NUM_THREADS')} "
                        f"threads {torch.get_num_threads()} mem {(torch.cuda.memory_allocated() if torch.cuda.is_available() else 0) / 2**30:.1f}G "
                        f"reserved {(torch.cuda.memory_reserved() if torch.cuda.is_available() else 0) / 2**30:.1f}G\n")
            return r

        W.PolicyWorker.train_step = train_step
    except Exception as e:  # noqa: BLE001
        print("sitecustomize:", e)


if os.environ.get("TRAIN_PROF"):
    import importlib.abc
    import sys

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "rl.runtime.worker":
                return None
            sys.meta_path.remove(self)
            import importlib.util
            spec = importlib.util.find_spec(name)
            loader = spec.loader
            orig_exec = loader.exec_module

            def exec_module(module):
                orig_exec(module)
                _patch(module)
            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())
