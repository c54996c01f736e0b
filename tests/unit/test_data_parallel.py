"""Data parallel training with PyTorch's own stack (rl/train/parallel.py): two real ranks over gloo, in two spawned
processes, against one rank on the same global batch.

One spawn (both ranks) runs every scenario and writes what it saw; the tests below check it:
- DDP and FSDP2, float32: the ranks' shards have unequal micro-batch counts (3 and 2); after two steps the
  weights equal the one-rank run's and are bit-identical on both ranks; DDP reduced once per step (no_sync
  on the others, so one bucket all-reduce per step, not one per micro-batch).
- PolicyWorker under FSDP2: a train step, then `update_weights` gathers the shards into the engine's own full
  copy (equal to one rank's weights, the same on both ranks); a checkpoint round trip (full tensors written
  by rank 0, shards read back) continues exactly; run.dtype bfloat16 (MixedPrecisionPolicy) trains too.
- PolicyWorker under DDP with run.dtype bfloat16: the engine's bf16 copy is refreshed in place and agrees.
- FSDP2 loads a checkpoint (one written by FSDP2, one by a single worker: both full tensors) reading only each
  rank's rows of the weights and of the AdamW moments (the bytes read per rank are counted from the slices
  read); the initial weights of run.init_checkpoint are read the same way once sharded (not before).
- OPD (full-vocabulary reverse KL to two teachers of other shapes, plus GRPO) under FSDP2 takes the one-rank
  steps; after each step the engines' weights are bit-identical on both ranks (the teachers are not sharded).
"""

from __future__ import annotations

import functools
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from model.decoder import Decoder
from rl.config import GRPOStage, OptimConfig, Recipe
from rl.train.losses import group_advantages
from rl.train.objectives import GRPOObjective, SFTObjective
from rl.train.parallel import deal_by_length
from rl.train.trainer import TrainBatch, Trainer, merge_step_metrics
from tests.conftest import debug_config
from tests.numerics import assert_close_to_reference, assert_paths_agree, decoder_rounding, float64_reference

STEPS, GROUP, MICRO = 2, 4, 3
WORKER_RECIPE = {
    "run": {"name": "dp", "seed": 0, "num_threads": 1},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
              "max_position_embeddings": 64, "ffn": {"type": "dense", "intermediate_size": 64}},
    "datasets": [{"type": "arithmetic", "max_digits": 2, "num_heldout": 4}],
    "engine": {"max_batch_size": 4, "block_size": 8, "max_seq_len": 48, "max_new_tokens": 4},
    "runtime": {"ray": True, "num_workers": 2, "parallel": "fsdp2"},
    "stages": [{"type": "sft", "batch_size": 12, "micro_batch_size": MICRO, "optim": {"lr": 1e-3}}],
}


def _groups(n_groups: int, seed: int = 0) -> TrainBatch:
    """Groups of GROUP rows with uneven lengths (the first group long), normalised by the global tokens."""
    g = torch.Generator().manual_seed(seed)
    n = n_groups * GROUP
    prompts = [tuple(torch.randint(3, 99, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist())
               for _ in range(n)]
    responses = [tuple(torch.randint(3, 99, (int(torch.randint(1, 9, (1,), generator=g)) + (12 if i < GROUP else 0),),
                                     generator=g).tolist()) for i in range(n)]
    adv = group_advantages(torch.rand(n, generator=g).tolist(), [f"g{i // GROUP}" for i in range(n)], std_normalize=False)
    logprobs = [tuple((-torch.rand(len(r), generator=g)).tolist()) for r in responses]
    return TrainBatch(prompts, responses, float(sum(map(len, responses))), logprobs, [(0,) * len(r) for r in responses],
                      None, adv)


def _shards(batch: TrainBatch, ranks: int) -> list[TrainBatch]:
    """Whole groups dealt by length, as the controller does (rl/algo/async_grpo.py)."""
    costs = [sum(len(batch.prompts_B[i]) + len(batch.responses_B[i]) for i in range(g * GROUP, (g + 1) * GROUP))
             for g in range(len(batch) // GROUP)]
    return [batch.select([g * GROUP + j for g in part for j in range(GROUP)]) for part in deal_by_length(costs, ranks)]


def _objective(model):
    return GRPOObjective(GRPOStage(group_size=GROUP, micro_batch_size=MICRO), model=model, temperature=1.0,
                         current_version=0)


def _grpo_steps(trainer: Trainer, batches: list[TrainBatch]) -> list[dict]:
    return [trainer.train_step(b, _objective(trainer.model)) for b in batches]


def _sft_batch(seed: int) -> TrainBatch:
    b = _groups(3, seed)
    return TrainBatch(b.prompts_B, b.responses_B, b.num_tokens)


def _opd_recipe(out: str) -> dict:
    """WORKER_RECIPE with an OPD stage: teachers ta (serves arith) and tb, of other shapes than the student."""
    stage = {"type": "opd", "group_size": GROUP, "micro_batch_size": MICRO, "rl_weight": 0.5, "kl_chunk_size": 16,
             "prompts_per_step": 2, "dispatch": {"max_inflight": 8},
             "optim": {"lr": 1e-3}, "teachers": {"prefetch": False, "teachers": [
                 {"name": "ta", "checkpoint": os.path.join(out, "ta"), "datasets": ["arith"]},
                 {"name": "tb", "checkpoint": os.path.join(out, "tb")}]}}
    return {**WORKER_RECIPE, "engine": {**WORKER_RECIPE["engine"], "max_batch_size": 8}, "stages": [stage]}


def _opd_batch(seed: int) -> TrainBatch:
    """GRPO groups whose rows are scored by teacher ta or tb, group by group."""
    import dataclasses

    b = _groups(3, seed)
    return dataclasses.replace(b, teachers_B=["ta" if (i // GROUP) % 2 == 0 else "tb" for i in range(len(b))])


def _local(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: v.to_local().detach().clone() for k, v in model.state_dict().items() if isinstance(v, DTensor)}


def _full(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


# -- what each rank runs ------------------------------------------------------------------------------------
def _rank_main(rank: int, port: int, out: str) -> None:
    import rl.train.parallel as parallel
    from rl.checkpoint.format import open_tree
    from rl.train.parallel import DDP, FSDP2, build_data_parallel, trainer_state_bytes
    from rl.runtime.worker import PolicyWorker

    torch.set_num_threads(1)
    res: dict = {}
    worker = PolicyWorker(Recipe.model_validate(WORKER_RECIPE), rank=rank, world_size=2, num_threads=1)
    worker.join_process_group(f"tcp://127.0.0.1:{port}")  # the process group every scenario below uses

    # DDP and FSDP2 on the trainer alone, float32, unequal micro-batch counts
    hooks = []
    summed = parallel.sum_allreduce

    @functools.wraps(summed)  # DDP inspects the hook's signature: keep the real one's
    def counted(group, bucket):
        hooks.append(1)
        return summed(group, bucket)

    parallel.sum_allreduce = counted
    for name, make in (("ddp", DDP), ("fsdp2", lambda m: FSDP2(m, bf16=False))):
        torch.manual_seed(0)
        model = Decoder(debug_config(moe=False)).float()
        dp = make(model)
        trainer = Trainer(model, OptimConfig(), parallel=dp)
        batches = [_shards(_groups(3, seed=s), 2)[rank] for s in range(STEPS)]
        res[name] = {"metrics": _grpo_steps(trainer, batches), "weights": _full(model),
                     "micro": [-(-len(b) // MICRO) for b in batches],
                     "state_bytes": trainer_state_bytes(model, trainer.opt)}
    res["ddp"]["hooks"] = len(hooks)

    # PolicyWorker, FSDP2 float32: engine copy, then a checkpoint round trip
    stage = Recipe.model_validate(WORKER_RECIPE).stages[0]
    worker.begin_stage(stage)
    batches = [_shards(_sft_batch(10 + s), 2)[rank] for s in range(2)]
    worker.train_step(batches[0], stage)
    worker.update_weights(1)
    res["worker"] = {"engine": _full(worker.rollout_model), "checksum": worker.info()["weights_checksum"]}
    worker.save(out)
    worker.train_step(batches[1], stage)
    res["worker"]["second"] = _full(worker.model)
    worker.load(out)
    worker.train_step(batches[1], stage)
    res["worker"]["second_after_load"] = _full(worker.model)

    # run.dtype bfloat16 under FSDP2 (MixedPrecisionPolicy) and under DDP (autocast, bf16 engine copy)
    for kind in ("fsdp2", "ddp"):
        recipe = Recipe.model_validate({**WORKER_RECIPE, "run": {**WORKER_RECIPE["run"], "dtype": "bfloat16"},
                                        "runtime": {**WORKER_RECIPE["runtime"], "parallel": kind}})
        w = PolicyWorker(recipe, rank=rank, world_size=2, num_threads=1)
        w.parallel = build_data_parallel(kind, w.model, bf16=True)  # join_process_group without a second group
        w.begin_stage(stage)
        m = w.train_step(batches[0], stage)
        w.update_weights(1)
        res[f"bf16_{kind}"] = {"loss": m.sums["sft/loss"], "engine": _full(w.rollout_model),
                               "dtype": str(next(w.rollout_model.parameters()).dtype)}

    # FSDP2 reads only its rows of a checkpoint written by FSDP2 (`out`, above) and of one by one worker
    for name, path in (("fsdp2", out), ("one_worker", os.path.join(out, "init"))):
        nbytes = worker.parallel.load_weights(path)
        res[f"load_{name}"] = {"bytes": nbytes, "local": _local(worker.model), "full": _full(worker.model)}
    with open_tree(out) as tree:  # and only its rows of the AdamW moments
        res["load_fsdp2"]["optimizer_bytes"] = worker.parallel.load_optimizer_state(worker.trainer.opt, tree["optimizer"])
    # the initial weights of run.init_checkpoint: read once sharded, each rank its rows
    init = Recipe.model_validate({**WORKER_RECIPE, "run": {**WORKER_RECIPE["run"], "init_checkpoint": os.path.join(out, "init")}})
    w = PolicyWorker(init, rank=rank, world_size=2, num_threads=1)
    res["init"] = {"before": _full(w.model)}
    w.join_process_group(f"tcp://127.0.0.1:{port}")  # in the group already: kept
    res["init"].update(trainer=_full(w.model), engine=_full(w.rollout_model))

    # OPD under FSDP2: the student sharded, the teachers whole on every rank
    opd = Recipe.model_validate(_opd_recipe(out))
    w = PolicyWorker(opd, rank=rank, world_size=2, num_threads=1)
    w.join_process_group(f"tcp://127.0.0.1:{port}")
    w.begin_stage(opd.stages[0])
    for step in range(STEPS):
        m = w.train_step(_shards(_opd_batch(20 + step), 2)[rank], opd.stages[0])
        w.update_weights(step + 1)
        res[f"opd{step}"] = {"metrics": m, "engine": _full(w.rollout_model), "checksum": w.info()["weights_checksum"]}
    _dump(res, os.path.join(out, f"rank{rank}"))


@pytest.fixture(scope="module")
def dp_out(tmp_path_factory):
    """The spawn's directory, with two teachers and an init checkpoint in it."""
    from model.checkpoint import save_checkpoint
    from rl.runtime.worker import build_policy

    out = tmp_path_factory.mktemp("dp")
    torch.manual_seed(1)  # teachers of other shapes than the student (same vocabulary); an init checkpoint
    save_checkpoint(Decoder(debug_config(moe=False, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8)), out / "ta")
    save_checkpoint(Decoder(debug_config(moe=True, num_layers=1)), out / "tb")
    init = build_policy(Recipe.model_validate({**WORKER_RECIPE, "run": {**WORKER_RECIPE["run"], "seed": 7}}))
    save_checkpoint(init, out / "init")  # one worker's checkpoint: full tensors
    return out


@pytest.fixture(scope="module")
def ranks(dp_out):
    out = dp_out
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(port, str(out)), nprocs=2, start_method="spawn")
    return [_load(out / f"rank{r}") for r in range(2)]


def _dump(tree: dict, path: str) -> None:
    """A nested dict of tensors and plain values as safetensors + JSON (no pickle: tests/unit/test_checkpoint_format.py)."""
    import json

    from safetensors.torch import save_file

    tensors, plain = {}, {}

    def walk(node, prefix):
        for k, v in node.items():
            key = f"{prefix}/{k}" if prefix else str(k)
            if isinstance(v, dict):
                walk(v, key)
            elif isinstance(v, torch.Tensor):
                tensors[key] = v.detach().cpu().contiguous()
            else:
                plain[key] = v
    walk(tree, "")
    save_file(tensors, path + ".safetensors")
    import dataclasses

    with open(path + ".json", "w") as f:  # StepMetrics as tagged maps
        json.dump(plain, f, default=lambda o: {"__step_metrics__": dataclasses.asdict(o)})


def _load(path) -> dict:
    import json

    from safetensors.torch import load_file

    tree: dict = {}
    from rl.train.trainer import StepMetrics

    def hook(d):
        return StepMetrics(**d["__step_metrics__"]) if "__step_metrics__" in d else d
    flat = {**load_file(str(path) + ".safetensors"), **json.loads(open(str(path) + ".json").read(), object_hook=hook)}
    for key, v in flat.items():
        *parents, leaf = key.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def _one_rank_trainer() -> Trainer:
    torch.manual_seed(0)
    return Trainer(Decoder(debug_config(moe=False)).float(), OptimConfig())


def _positions(batch: TrainBatch) -> int:
    """Packed positions of a step (rows × the longest row): the longest sum into a weight's gradient."""
    return len(batch) * max(len(p) + len(r) - 1 for p, r in zip(batch.prompts_B, batch.responses_B))


def _metric_rounding(configs, positions: int, model: torch.nn.Module) -> dict[str, dict]:
    """tests/numerics.py's `reduction` and `depth` for a step's metrics, from the decoders whose chains feed them (the
    student, and an OPD step's teacher alongside it): the loss, their forward chains; the gradient norm, the backward
    chain into each gradient element, its square, the sum of squares of every element (in any order: across tensors
    and ranks alike) and the square root. Scale: the metric's own magnitude (a norm's terms are like-signed)."""
    chains = [decoder_rounding(c, positions, backward=False) for c in configs]
    forward = {"reduction": max(c["reduction"] for c in chains), "depth": sum(c["depth"] for c in chains)}
    elements = sum(p.numel() for p in model.parameters())
    return {"loss": forward,
            "norm": {"reduction": [(forward["reduction"], 2 * forward["depth"] + 1), (elements, 1), (1, 2)]}}


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_two_ranks_take_the_one_rank_steps_and_hold_identical_weights(ranks, kind):
    batches = [_groups(3, seed=s) for s in range(STEPS)]
    one = _one_rank_trainer()
    alone = [merge_step_metrics([m]) for m in _grpo_steps(one, batches)]
    exact = Trainer(_one_rank_trainer().model.double(), OptimConfig())  # the same steps in float64
    with float64_reference():
        exact_metrics = [merge_step_metrics([m]) for m in _grpo_steps(exact, batches)]
    r0, r1 = ranks[0][kind], ranks[1][kind]
    assert r0["micro"] != r1["micro"]  # unequal micro-batch counts per rank (3 and 2): idle ones pad the short rank
    for name, w in one.model.state_dict().items():
        # fp32: sums in another order; AdamW turns a tiny gradient's relative error into a few 1e-6
        torch.testing.assert_close(r0["weights"][name], w, rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(r0["weights"][name], r1["weights"][name]), name  # bit-identical ranks
    # the one-rank and the two-rank metrics are the float64 steps' to float32 rounding (tests/numerics.py). From the
    # second step on the float32 weights also carry AdamW's response to the first gradients' rounding (a few 1e-6,
    # above); the metrics' response to that is of the order of the rounding itself, inside the one-step bound
    for step in range(STEPS):
        merged = merge_step_metrics([r0["metrics"][step], r1["metrics"][step]])
        bound = _metric_rounding([one.model.config], _positions(batches[step]), one.model)
        for k, rounding in (("rl/loss", bound["loss"]), ("train/grad_norm", bound["norm"])):
            for name, got in (("one rank", alone[step][k]), (kind, merged[k])):
                assert_close_to_reference(got, exact_metrics[step][k], dtype=torch.float32, msg=(step, k, name),
                                          **rounding)


def test_fsdp2_ranks_hold_about_half_the_trainer_state_ddp_ranks_hold_all(ranks):
    from rl.train.parallel import trainer_state_bytes

    one = _one_rank_trainer()
    _grpo_steps(one, [_groups(3, seed=0)])
    full = trainer_state_bytes(one.model, one.opt)  # weights, gradients, AdamW's two moments and step counters
    params = list(one.model.parameters())
    assert 4 * sum(p.numel() * 4 for p in params) < full <= 4 * sum(p.numel() * 4 for p in params) + 8 * len(params)
    assert ranks[0]["ddp"]["state_bytes"] == ranks[1]["ddp"]["state_bytes"] == full
    shards = [ranks[r]["fsdp2"]["state_bytes"] for r in range(2)]
    assert sum(shards) >= full and all(0.45 <= b / full <= 0.55 for b in shards), (shards, full)


def test_ddp_reduces_once_per_step_not_per_micro_batch(ranks):
    # one bucket (the debug model is far below DDP's first bucket size) per synchronising backward: no_sync
    # held every earlier micro-batch's gradient locally
    assert ranks[0]["ddp"]["hooks"] == ranks[1]["ddp"]["hooks"] == STEPS


def test_fsdp2_worker_engine_gets_full_weights_and_a_checkpoint_round_trip_continues(ranks):
    from rl.runtime.worker import build_policy

    recipe = Recipe.model_validate({**WORKER_RECIPE, "runtime": {"ray": False}})
    one = Trainer(build_policy(recipe), recipe.stages[0].optim)
    one.train_step(_sft_batch(10), SFTObjective(recipe.stages[0]))
    w0, w1 = ranks[0]["worker"], ranks[1]["worker"]
    for name, w in one.model.state_dict().items():
        torch.testing.assert_close(w0["engine"][name], w, rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(w0["engine"][name], w1["engine"][name]), name
    assert w0["checksum"] == w1["checksum"]
    for r in (w0, w1):  # step 2 after restoring step 1's checkpoint (weights and AdamW state) = step 2 without it
        for name, w in r["second"].items():
            assert torch.equal(r["second_after_load"][name], w), name


@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_bfloat16_trains_and_refreshes_the_bf16_engine_copy_on_both_ranks(ranks, kind):
    from rl.runtime.worker import build_policy

    r0, r1 = ranks[0][f"bf16_{kind}"], ranks[1][f"bf16_{kind}"]
    assert r0["dtype"] == r1["dtype"] == "torch.bfloat16"
    init = build_policy(Recipe.model_validate({**WORKER_RECIPE, "runtime": {"ray": False}})).state_dict()
    assert any(not torch.equal(r0["engine"][k], v.to(torch.bfloat16)) for k, v in init.items())  # it moved
    for name in r0["engine"]:
        assert torch.equal(r0["engine"][name], r1["engine"][name]), name
    assert torch.isfinite(torch.tensor(r0["loss"] + r1["loss"]))


@pytest.mark.parametrize("written_by", ["fsdp2", "one_worker"])
def test_fsdp2_ranks_read_only_their_rows_of_a_checkpoint(ranks, dp_out, written_by):
    from safetensors.torch import load_file

    file = load_file(str((dp_out if written_by == "fsdp2" else dp_out / "init") / "model.safetensors"))  # a full load
    r0, r1 = ranks[0][f"load_{written_by}"], ranks[1][f"load_{written_by}"]
    assert set(r0["local"]) == set(r0["full"]) == set(file)  # every tensor sharded, every one loaded
    for name, t in file.items():
        assert torch.equal(r0["full"][name], t) and torch.equal(r1["full"][name], t), name
        assert torch.equal(torch.cat([r0["local"][name], r1["local"][name]]), t), name  # rank 0 the first rows
        assert 0 < len(r1["local"][name]) <= len(r0["local"][name]), name
    total = sum(t.numel() * t.element_size() for t in file.values())
    assert r0["bytes"] + r1["bytes"] == total  # each row read once, by the rank that keeps it
    assert 0.45 * total < r0["bytes"] < 0.55 * total, (r0["bytes"], total)


def test_fsdp2_ranks_read_only_their_rows_of_the_adamw_moments(ranks, dp_out):
    from rl.checkpoint.format import open_tree

    with open_tree(dp_out) as tree:  # the FSDP2 worker's checkpoint: AdamW state of full tensors
        state = [v.read() for s in tree["optimizer"]["state"].values() for v in s.values()]
    moments = sum(t.numel() * t.element_size() for t in state if t.dim() > 0)
    steps = sum(t.numel() * t.element_size() for t in state if t.dim() == 0)  # scalars: every rank reads them
    r0, r1 = ranks[0]["load_fsdp2"]["optimizer_bytes"], ranks[1]["load_fsdp2"]["optimizer_bytes"]
    assert moments > 0 and r0 + r1 == moments + 2 * steps
    assert 0.45 * moments < r0 - steps < 0.55 * moments, (r0, moments)


def test_fsdp2_reads_the_initial_weights_once_sharded(ranks, dp_out):
    from safetensors.torch import load_file

    from rl.runtime.worker import build_policy

    file = load_file(str(dp_out / "init" / "model.safetensors"))
    seeded = build_policy(Recipe.model_validate({**WORKER_RECIPE, "runtime": {"ray": False}})).state_dict()
    assert any(not torch.equal(seeded[k], t) for k, t in file.items())
    for r in ranks:
        for name, t in file.items():
            assert torch.equal(r["init"]["before"][name], seeded[name]), name  # built; the file not read yet
            assert torch.equal(r["init"]["trainer"][name], t) and torch.equal(r["init"]["engine"][name], t), name


def test_opd_under_fsdp2_takes_the_one_rank_steps_with_identical_weights_on_both_ranks(ranks, dp_out):
    from model.checkpoint import load_config
    from rl.runtime.worker import PolicyWorker

    recipe = Recipe.model_validate({**_opd_recipe(str(dp_out)), "runtime": {"ray": False}})
    stage = recipe.stages[0]
    one = PolicyWorker(recipe, num_threads=1)
    one.begin_stage(stage)
    teachers = [load_config(t.checkpoint) for t in stage.teachers.teachers]
    for step in range(STEPS):
        batch = _opd_batch(20 + step)
        alone = merge_step_metrics([one.train_step(batch, stage)])
        one.update_weights(step + 1)
        r0, r1 = ranks[0][f"opd{step}"], ranks[1][f"opd{step}"]
        merged = merge_step_metrics([r0["metrics"], r1["metrics"]])
        # the two float32 runs agree to the rounding of one step through the student and the deeper teacher
        # (tests/numerics.py; the teachers run only in float32, so two paths against each other, not a reference)
        deeper = max(teachers, key=lambda c: decoder_rounding(c, 1, backward=False)["depth"])
        bound = _metric_rounding([recipe.model, deeper], _positions(batch), one.model)
        for k in ("opd/kl_loss", "opd/kl_sum", "rl/loss", "train/grad_norm"):
            assert_paths_agree(merged[k], alone[k], dtype=torch.float32, msg=(step, k),
                               **bound["norm" if k == "train/grad_norm" else "loss"])
        assert alone["opd/kl_loss"] > 0 and alone["opd/teachers_in_step"] == 2  # both teachers scored rows
        for name, w in one.model.state_dict().items():
            torch.testing.assert_close(r0["engine"][name], w, rtol=1e-5, atol=1e-5, msg=name)
            assert torch.equal(r0["engine"][name], r1["engine"][name]), (step, name)  # bit-identical ranks
        assert r0["checksum"] == r1["checksum"]


def test_deal_by_length_keeps_groups_whole_and_balances_tokens():
    costs = [90, 10, 40, 40, 20, 20, 10]
    parts = deal_by_length(costs, 2)
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    assert [sum(costs[i] for i in p) for p in parts] == [110, 120] or [sum(costs[i] for i in p) for p in parts] == [120, 110]
    assert deal_by_length([5.0], 3) == [[0], [], []]  # fewer groups than ranks: the others idle
