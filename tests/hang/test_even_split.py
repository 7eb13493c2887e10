"""An even split (two ranks) decided by the step the communicator repeats, and the user's line of each side.

Issue #23: FSDP2 on two ranks, one rank skipped the step's logging all_reduce and the verdict named no
one. The histories here mirror a real FSDP2 step (bench/fsdp_job.py's order, captured on CPU/gloo and
as NCCL issues it): an all_gather of the root and of each of 8 identical blocks in the forward, in the
backward an all_gather per block (the next one prefetched) interleaved with a reduce_scatter per block
on a second stream, the root's reduce_scatter, then the loss all_reduce: 27 collectives, bf16 gathers and
fp32 reductions.  Each rule that names a rank has a case beside it where nothing decides and no one is named.
"""

from __future__ import annotations

import random

import nccl_lines as L
from conftest import NOW
from harness import judged_with_report, verdict_of

from ncclwatch.watchdog.events import (
    Citation,
    Event,
    FrDump,
    FrEntry,
    FrFrame,
    FrProcessGroup,
    OpState,
    StackDump,
    ThreadStack,
    WorkerSeen,
)
from ncclwatch.watchdog.hang.report import render_text
from ncclwatch.watchdog.hang.stacks import user_frame
from ncclwatch.watchdog.hang.step_pattern import expected_next, learn_steps
from ncclwatch.watchdog.hang.verdicts import Verdict

BF16, FP32 = 9, 7  # NCCL's datatype numbers
TORCH = "/venv/lib/python3.12/site-packages/torch/distributed"
# (NCCL op, count, dtype, the user's frame Flight Recorder records: None where the op is issued from autograd's
# device thread, whose stack holds FSDP's hooks only)
AG_ROOT = ("AllGather", 263168, BF16, "main (/job/train.py:64)")
AG_BLOCK = ("AllGather", 197248, BF16, "forward (/job/model.py:31)")
AG_BLOCK_BWD = ("AllGather", 197248, BF16, None)
RS_BLOCK = ("ReduceScatter", 197248, FP32, None)
RS_ROOT = ("ReduceScatter", 263168, FP32, None)
AR_CLIP = ("AllReduce", 1, FP32, "main (/job/train.py:69)")  # clip_grad_norm_'s total norm: the same size as the loss
AR_LOSS = ("AllReduce", 1, FP32, "main (/job/train.py:71)")
BLOCKS = 8


def fsdp2_step(rng: random.Random | None = None, clip: bool = False, micro: int = 1) -> list[tuple]:
    """One step's collectives in issue order. ``rng``: the backward's all_gather and reduce_scatter pairs swap at
    random (two streams); ``micro``: micro-batches, gradients reduce-scattered on the last only."""
    ops: list[tuple] = []
    for m in range(micro):
        ops += [AG_ROOT] + [AG_BLOCK] * BLOCKS
        if m < micro - 1:
            ops += [AG_BLOCK_BWD] * BLOCKS
            continue
        ops.append(AG_BLOCK_BWD)
        for _ in range(BLOCKS - 1):
            pair = [AG_BLOCK_BWD, RS_BLOCK]
            ops += pair[::-1] if rng is not None and rng.random() < 0.5 else pair
        ops += [RS_BLOCK, RS_ROOT]
    return ops + ([AR_CLIP] if clip else []) + [AR_LOSS]


def job(steps: int, skip_step: int | None = None, skip_rank: int = 1, seed: int | None = 7, **kw) -> list[list[tuple]]:
    """Two ranks' sequences; at ``skip_step`` the skipping rank leaves out the loss all_reduce and goes on."""
    ranks = []
    for rank in range(2):
        rng = random.Random(seed) if seed is not None else None  # both ranks issue the same order: it is the code's
        ops: list[tuple] = []
        for step in range(steps):
            body = fsdp2_step(rng, **kw)
            if step == skip_step and rank == skip_rank:
                body = body[:-1]
            ops += body
        ranks.append(ops)
    return ranks


def logs_of(sequences: list[list[tuple]]) -> dict[str, str]:
    return {
        f"r{r}.log": L.init(r, 2, f"0xc{r}") + "".join(L.op(r, op, n, f"0xc{r}", dtype=d) for op, n, d, _ in ops)
        for r, ops in enumerate(sequences)
    }


def frames(op: tuple) -> list[FrFrame]:
    name = {"AllGather": "all_gather_into_tensor", "ReduceScatter": "reduce_scatter_tensor", "AllReduce": "all_reduce"}
    stack = [FrFrame(name=name[op[0]], filename=f"{TORCH}/distributed_c10d.py", line=4000)]
    if op[3] is None:
        return stack + [
            FrFrame(name="post_backward", filename=f"{TORCH}/fsdp/_fully_shard/_fsdp_param_group.py", line=500)
        ]
    func, _, where = op[3].partition(" (")
    path, _, line = where.rstrip(")").rpartition(":")
    return stack + [FrFrame(name=func, filename=path, line=int(line))]


def sequence_dumps(sequences: list[list[tuple]], kept: int = 2000) -> list[FrDump]:
    """Flight Recorder's dumps of the two ranks: its newest ``kept`` entries; the last two still pending."""
    dtype = {BF16: "BFloat16", FP32: "Float"}
    group = {"0": FrProcessGroup(pg_id="0", desc="default_pg", ranks=[0, 1])}
    dumps = []
    for rank, ops in enumerate(sequences):
        first = max(0, len(ops) - kept)
        entries = [
            FrEntry(
                index=i - first,
                pg_id="0",
                collective_seq_id=i + 1,
                profiling_name=f"nccl:{op[0].lower()}",
                op=op[0],
                is_p2p=False,
                input_sizes=[[op[1] * (2 if op[0] == "ReduceScatter" else 1)]],
                input_dtypes=[dtype[op[2]]],
                state=OpState.completed if i < len(ops) - 2 else OpState.scheduled,
                frames=frames(op),
            )
            for i, op in enumerate(ops)
            if i >= first
        ]
        dumps.append(
            FrDump(
                rank=rank, version="2.10", process_groups=group, entries=entries, cite=Citation(file=f"fr/rank{rank}")
            )
        )
    return dumps


def keys(ops: list[tuple]) -> list[tuple]:
    return [(op, n, d) for op, n, d, _ in ops]


class TestStepShape:
    def test_an_fsdp2_step_is_learned_though_its_layers_repeat_one_signature(self) -> None:
        shape = learn_steps(keys(job(6, seed=None)[0]))
        assert shape is not None and shape.period() == "27 operations" and shape.fixed
        assert shape.times(keys([AG_BLOCK])[0]) == "16 times" and shape.times(keys([AR_LOSS])[0]) == "once"

    def test_two_streams_swapping_operations_between_steps_give_the_same_step(self) -> None:
        shape = learn_steps(keys(job(6, seed=3)[0]))
        assert shape is not None and shape.period() == "27 operations"

    def test_a_variable_number_of_micro_batches_gives_a_variable_step(self) -> None:
        rng = random.Random(5)
        history = keys([op for _ in range(8) for op in fsdp2_step(micro=rng.choice((2, 3)))])
        shape = learn_steps(history)
        assert shape is not None and shape.period() == "44-61 operations" and not shape.fixed

    def test_less_than_two_whole_steps_learns_nothing(self) -> None:
        assert learn_steps(keys(job(2, seed=None)[0])[:-1]) is None

    def test_an_older_unlike_step_is_left_out(self) -> None:
        warmup = [("Broadcast", 64, FP32)] * 5
        shape = learn_steps(warmup + keys(job(4, seed=None)[0]))
        assert shape is not None and shape.period() == "27 operations"


class TestEvenSplitFromNcclLogs:
    """NCCL's log: no frames, the clip norm's and the loss's all_reduce have one signature."""

    def test_the_rank_that_skipped_the_loss_all_reduce_is_named(self) -> None:
        finding = verdict_of(logs_of(job(12, skip_step=9)))
        assert (finding.verdict, finding.culprits) == (Verdict.collective_mismatch, (1,))
        assert finding.reason.startswith(
            "Culprit because the ranks split evenly and the step this communicator repeats decides: "
            "rank 1 skipped AllReduce count=1 float32 sum, which every step issues once; it is "
            "already at AllGather count=263168 bfloat16, which this step already issued: the next step's"
        )

    def test_the_culprit_does_not_depend_on_which_rank_skipped(self) -> None:
        assert verdict_of(logs_of(job(12, skip_step=9, skip_rank=0))).culprits == (0,)

    def test_with_gradient_clipping_two_identical_all_reduces_a_step(self) -> None:
        finding = verdict_of(logs_of(job(12, skip_step=9, clip=True)))
        assert finding.culprits == (1,) and "which every step issues 2 times" in finding.reason

    def test_with_a_variable_number_of_micro_batches_the_order_decides(self) -> None:
        sequences = []
        for rank in range(2):
            rng, ops = random.Random(11), []
            for step in range(10):
                body = fsdp2_step(micro=rng.choice((2, 3)))
                ops += body[:-1] if (rank, step) == (1, 8) else body
            sequences.append(ops)
        finding = verdict_of(logs_of(sequences))
        assert finding.culprits == (1,)
        assert (
            "where, in 8 of the last 8 steps, ReduceScatter count=263168 float32 sum was followed by AllReduce count=1 "
            "float32 sum and never by it" in finding.reason
        )

    def test_an_added_operation_no_step_issues_is_named(self) -> None:
        sequences = job(12, seed=None)
        sequences[0][-1:-1] = [("AllReduce", 12345, FP32, None)]  # rank 0: an extra all_reduce before the loss's
        finding = verdict_of(logs_of(sequences))
        assert (
            finding.culprits == (0,)
            and "which no step issues, where the step still owes AllReduce count=1" in finding.reason
        )

    def test_a_divergence_in_the_first_step_names_no_one(self) -> None:
        finding = verdict_of(logs_of(job(2, skip_step=0)))
        assert (finding.verdict, finding.culprits) == (Verdict.collective_mismatch, ())
        assert finding.reason.startswith(
            "No culprit: the ranks split evenly and no step repeats in the recorded history"
        )
        assert "Culprit because" not in finding.reason
        assert any("TORCH_FR_BUFFER_SIZE" in m for m in finding.missing)
        assert finding.summary.endswith("Both sides are suspects.")

    def test_a_datatype_changed_before_any_step_repeats_is_named(self) -> None:
        # The fault suite's dtype case at step 1 of 2 ranks on the H200: rank 0 passes the loss all_reduce a bf16
        # tensor; step 0 issued it on both ranks in fp32, and no rank ever issued it in bf16.
        sequences = job(2)
        sequences[0][-1] = ("AllReduce", 1, BF16, "inject (/job/train.py:260)")
        finding = verdict_of(logs_of(sequences))
        assert (finding.verdict, finding.culprits, finding.kind) == (Verdict.collective_mismatch, (0,), "dtype")
        assert finding.summary.startswith("rank 0 passes bfloat16 where rank 1 passes float32 to AllReduce")
        assert "every rank issued AllReduce count=1 float32 sum before it where no rank ever passed bfloat16" in (
            finding.reason
        )

    def test_a_datatype_both_sides_issued_before_names_no_one(self) -> None:
        sequences = job(2)
        for ops in sequences:
            ops.insert(0, ("AllReduce", 1, BF16, None))  # the same all_reduce in bf16 is part of the job
        sequences[0][-1] = ("AllReduce", 1, BF16, None)
        finding = verdict_of(logs_of(sequences))
        assert (finding.verdict, finding.culprits) == (Verdict.collective_mismatch, ())

    def test_two_operations_issued_in_either_order_by_earlier_steps_name_no_one(self) -> None:
        # Both ranks run the same code, whose two streams issue an all_gather and a reduce_scatter in either
        # order; this time the ranks disagree: neither is wrong by the step.
        sequences = job(12, seed=3)
        at = len(fsdp2_step()) * 11 + 1 + BLOCKS + 1  # the last step's first pair in the backward
        sequences[1][at], sequences[1][at + 1] = sequences[0][at + 1], sequences[0][at]
        finding = verdict_of(logs_of(sequences))
        assert (finding.verdict, finding.culprits) == (Verdict.collective_mismatch, ())
        assert "in either order" in finding.reason

    def test_an_operation_some_older_steps_issued_names_no_one(self) -> None:
        # A branch on data: a few old steps all_reduced a metric, the recent ones did not; now rank 0 does again.
        metric = ("AllReduce", 4, FP32, None)
        sequences = job(12, seed=None)
        for ops in sequences:
            ops[len(fsdp2_step()) * 2 - 1 : len(fsdp2_step()) * 2 - 1] = [metric]
        sequences[0][-1:-1] = [metric]
        finding = verdict_of(logs_of(sequences))
        assert finding.culprits == () and "was issued in earlier ones" in finding.reason


class TestCallSites:
    """Flight Recorder records each operation's stack when it is issued: that line, not where py-spy finds the rank."""

    @staticmethod
    def stacks(frames_of: dict[int, list[str]]) -> list[Event]:
        events: list[Event] = []
        for rank, frames in frames_of.items():
            events += [
                WorkerSeen(pid=1000 + rank, rank=rank, host="node1", at=NOW - 60),
                StackDump(
                    pid=1000 + rank,
                    threads=[ThreadStack(name="MainThread", frames=frames)],
                    cite=Citation(file="py-spy"),
                ),
            ]
        return events

    BACKWARD = ["_engine_run_backward (torch/autograd/graph.py:829)", "main (/job/train.py:67)"]
    IN_ALL_REDUCE = ["all_reduce (torch/distributed/distributed_c10d.py:3068)", "main (/job/train.py:71)"]

    def test_each_side_gets_the_line_that_issued_its_operation(self) -> None:
        finding, report = judged_with_report(
            *sequence_dumps(job(12, skip_step=9)), *self.stacks({0: self.IN_ALL_REDUCE, 1: self.BACKWARD})
        )
        assert finding.culprits == (1,)
        assert "rank 1 skipped AllReduce count=1 Float at train.py:71" in finding.reason
        assert "it is already at AllGather count=263168 BFloat16 at train.py:64" in finding.reason
        sites = {row.rank: row.call_site for row in report.ranks}
        assert (
            sites[0]
            and sites[0].endswith("<- main (/job/train.py:71)")
            and sites[1]
            and sites[1].endswith("<- main (/job/train.py:64)")
        )
        assert (
            report.headline
            and (
                "— issued from train.py:64 in main() (py-spy: now at train.py:67 in main()); its peers "
                "issued theirs from train.py:71 in main()"
            )
            in report.headline
        )

    def test_the_table_shows_py_spy_on_a_second_line_only_where_it_differs(self) -> None:
        _, report = judged_with_report(
            *sequence_dumps(job(12, skip_step=9)), *self.stacks({0: self.IN_ALL_REDUCE, 1: self.BACKWARD})
        )
        table = render_text(report).split("\n\n")[1].splitlines()
        assert "call site" in table[0]
        rank0, rank1, now = table[1], table[2], table[3]
        assert rank0.rstrip().endswith("all_reduce <- main (train.py:71)") and rank1.startswith("  1 ")
        assert now.strip() == "now: _engine_run_backward <- main (train.py:67)" and len(table) == 4

    def test_a_tie_names_both_sides_with_their_lines(self) -> None:
        finding, report = judged_with_report(*sequence_dumps(job(2, skip_step=0)))
        assert finding.culprits == ()
        assert "rank 0 issued AllReduce count=1 Float at train.py:71; rank 1 issued AllGather" in finding.summary
        assert (
            report.headline
            and "rank 0 from train.py:71 in main(), rank 1 from train.py:64 in main()" in report.headline
        )

    def test_a_verdict_from_nccl_logs_takes_the_lines_from_flight_recorder(self) -> None:
        sequences = job(12, skip_step=9)
        finding, report = judged_with_report(*sequence_dumps(sequences), logs=logs_of(sequences))
        assert finding.source == "nccl_log" and finding.culprits == (1,)
        assert [row.call_site.rpartition(" <- ")[2] for row in report.ranks if row.call_site] == [
            "main (/job/train.py:71)",
            "main (/job/train.py:64)",
        ]

    def test_a_dump_too_short_for_a_step_leaves_the_split_to_the_longer_nccl_log(self) -> None:
        sequences = job(12, skip_step=10)
        finding, _ = judged_with_report(*sequence_dumps(sequences, kept=30), logs=logs_of(sequences))
        assert (finding.source, finding.culprits) == ("nccl_log", (1,))
        finding, _ = judged_with_report(*sequence_dumps(sequences, kept=30))
        assert finding.culprits == ()


def test_native_frames_of_py_spy_are_never_the_users_line() -> None:
    # A bundle holds py-spy's --native dump too: its innermost frames are in shared objects.
    native = ["0x7f65964a3f16 (libc.so.6:0)", "time_sleep (/usr/lib/libpython3.11.so.1.0:0)", "main (/job/train.py:67)"]
    assert user_frame(native) == "main (/job/train.py:67)"


def test_expected_next_is_a_pure_function_of_keys() -> None:
    history = ["a", "b", "c"] * 3 + ["a", "b"]
    assert expected_next(history, ["c", "a"]).expected == "c"
    assert expected_next(history, ["x", "y"]).expected is None
