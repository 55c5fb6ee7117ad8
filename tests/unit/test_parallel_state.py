"""parallel_state against layouts written out by hand (Megatron's rank order:
global = tp_rank + cp_rank * TP + dp_rank * TP * CP + pp_rank * TP * CP * DP)."""
import pytest
import torch.distributed as dist

from megatron.core import parallel_state as ps

# (TP, PP) on 8 ranks -> every group of each kind, literally.
EXPECTED = {
    (2, 2): dict(
        tensor=[[0, 1], [2, 3], [4, 5], [6, 7]],
        data=[[0, 2], [1, 3], [4, 6], [5, 7]],
        pipeline=[[0, 4], [1, 5], [2, 6], [3, 7]],
        model=[[0, 1, 4, 5], [2, 3, 6, 7]],
        embedding=[[0, 4], [1, 5], [2, 6], [3, 7]],
    ),
    (2, 4): dict(
        tensor=[[0, 1], [2, 3], [4, 5], [6, 7]],
        data=[[0], [1], [2], [3], [4], [5], [6], [7]],
        pipeline=[[0, 2, 4, 6], [1, 3, 5, 7]],
        model=[[0, 1, 2, 3, 4, 5, 6, 7]],
        embedding=[[0, 6], [1, 7]],
    ),
    (4, 2): dict(
        tensor=[[0, 1, 2, 3], [4, 5, 6, 7]],
        data=[[0], [1], [2], [3], [4], [5], [6], [7]],
        pipeline=[[0, 4], [1, 5], [2, 6], [3, 7]],
        model=[[0, 1, 2, 3, 4, 5, 6, 7]],
        embedding=[[0, 4], [1, 5], [2, 6], [3, 7]],
    ),
    (1, 8): dict(
        tensor=[[0], [1], [2], [3], [4], [5], [6], [7]],
        data=[[0], [1], [2], [3], [4], [5], [6], [7]],
        pipeline=[[0, 1, 2, 3, 4, 5, 6, 7]],
        model=[[0, 1, 2, 3, 4, 5, 6, 7]],
        embedding=[[0, 7]],
    ),
    (8, 1): dict(
        tensor=[[0, 1, 2, 3, 4, 5, 6, 7]],
        data=[[0], [1], [2], [3], [4], [5], [6], [7]],
        pipeline=[[0], [1], [2], [3], [4], [5], [6], [7]],
        model=[[0, 1, 2, 3, 4, 5, 6, 7]],
        embedding=[[0], [1], [2], [3], [4], [5], [6], [7]],
    ),
}

GETTERS = {
    "tensor": ps.get_tensor_model_parallel_group,
    "data": ps.get_data_parallel_group,
    "pipeline": ps.get_pipeline_model_parallel_group,
    "model": ps.get_model_parallel_group,
    "embedding": ps.get_embedding_group,
}


def _mine(groups, rank):
    """The group holding ``rank``, or None (middle stages are in no embedding group)."""
    mine = [g for g in groups if rank in g]
    assert len(mine) <= 1
    return mine[0] if mine else None


def _ranks_of(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _check_all_layouts():
    """Runs on each of 8 ranks; returns the failures it saw (empty when all match)."""
    me = dist.get_rank()
    errors = []

    def check(what, got, want):
        if got != want:
            errors.append(f"rank {me} {what}: got {got}, expected {want}")

    for (tp, pp), expected in EXPECTED.items():
        ps.initialize_model_parallel(tp, pp)
        where = f"TP={tp} PP={pp}"
        for kind, groups in expected.items():
            want = _mine(groups, me)
            check(f"{where} {kind} group", _ranks_of(GETTERS[kind]()), want)
        tp_ranks = _mine(expected["tensor"], me)
        dp_ranks = _mine(expected["data"], me)
        pp_ranks = _mine(expected["pipeline"], me)
        check(f"{where} data gloo group",
              dist.get_process_group_ranks(ps.get_data_parallel_group(with_gloo=True)), dp_ranks)
        check(f"{where} tp size/rank", (ps.get_tensor_model_parallel_world_size(),
                                         ps.get_tensor_model_parallel_rank()),
              (len(tp_ranks), tp_ranks.index(me)))
        check(f"{where} dp size/rank", (ps.get_data_parallel_world_size(),
                                         ps.get_data_parallel_rank()),
              (len(dp_ranks), dp_ranks.index(me)))
        check(f"{where} pp size/rank", (ps.get_pipeline_model_parallel_world_size(),
                                         ps.get_pipeline_model_parallel_rank()),
              (len(pp_ranks), pp_ranks.index(me)))
        check(f"{where} mp size", ps.get_model_parallel_world_size(), tp * pp)
        stage = pp_ranks.index(me)
        check(f"{where} next/prev", (ps.get_pipeline_model_parallel_next_rank(),
                                     ps.get_pipeline_model_parallel_prev_rank()),
              (pp_ranks[(stage + 1) % pp], pp_ranks[(stage - 1) % pp]))
        check(f"{where} first/last", (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()),
              (stage == 0, stage == pp - 1))
        check(f"{where} first/last rank", (ps.get_pipeline_model_parallel_first_rank(),
                                           ps.get_pipeline_model_parallel_last_rank()),
              (pp_ranks[0], pp_ranks[-1]))
        check(f"{where} tp src", ps.get_tensor_model_parallel_src_rank(), tp_ranks[0])
        check(f"{where} in embedding group", ps.is_rank_in_embedding_group(),
              stage in (0, pp - 1))
        ps.destroy_model_parallel()
        check(f"{where} destroyed", ps.model_parallel_is_initialized(), False)
    return errors


def test_groups_match_hand_written_layouts_on_8_ranks():
    from tests.distributed import run_distributed

    errors = sum(run_distributed(_check_all_layouts, world_size=8), [])
    assert errors == []


def _virtual_stages():
    """PP=4 with 3 virtual chunks: first/last stage depend on the chunk being run."""
    seen = []
    for chunk in range(3):
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        seen.append((ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(),
                     ps.is_pipeline_first_stage(ignore_virtual=True),
                     ps.is_pipeline_last_stage(ignore_virtual=True),
                     ps.is_rank_in_embedding_group()))
    return (ps.get_virtual_pipeline_model_parallel_world_size(), seen)


def _in_model_chunk():
    """in_model_chunk(c) answers stage queries for chunk c and returns to chunk 0."""
    inside = []
    for chunk in range(3):
        with ps.in_model_chunk(chunk):
            inside.append((ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()))
        assert ps.get_virtual_pipeline_model_parallel_rank() == 0
    return inside


def _in_model_chunk_without_virtual_stages():
    with ps.in_model_chunk(0):
        first = ps.is_pipeline_first_stage()
    try:
        with ps.in_model_chunk(1):
            pass
    except ValueError as exc:
        return first, str(exc)
    return first, None


def test_in_model_chunk():
    from tests.distributed import run_distributed

    F, T = False, True
    got = run_distributed(_in_model_chunk, world_size=2, pp=2, vpp=3)
    assert got == [[(T, F), (F, F), (F, F)], [(F, F), (F, F), (F, T)]]
    got = run_distributed(_in_model_chunk_without_virtual_stages, world_size=1, pp=1)
    assert got == [(True, "model chunk 1 without virtual pipeline stages.")]


def test_virtual_pipeline_stages():
    from tests.distributed import run_distributed

    got = run_distributed(_virtual_stages, world_size=4, pp=4, vpp=3)
    F, T = False, True
    assert got == [
        (3, [(T, F, T, F, T), (F, F, T, F, F), (F, F, T, F, F)]),  # PP rank 0: chunk 0 is first
        (3, [(F, F, F, F, F)] * 3),
        (3, [(F, F, F, F, F)] * 3),
        (3, [(F, F, F, T, F), (F, F, F, T, F), (F, T, F, T, T)]),  # PP rank 3: chunk 2 is last
    ]


def _bad_inputs():
    messages = []
    for args in [(3, 1), (2, 3), (1, 1, 2), (0, 1)]:
        try:
            ps.initialize_model_parallel(*args)
        except (RuntimeError, ValueError) as exc:
            messages.append(str(exc))
        else:
            messages.append(None)
        ps.destroy_model_parallel()
    try:
        ps.get_tensor_model_parallel_group()
    except RuntimeError as exc:
        messages.append(str(exc))
    ps.initialize_model_parallel(2, 2)
    try:
        ps.initialize_model_parallel(2, 2)
    except RuntimeError as exc:
        messages.append(str(exc))
    try:
        ps.set_virtual_pipeline_model_parallel_rank(0)
    except RuntimeError as exc:
        messages.append(str(exc))
    return messages


def test_clear_errors():
    from tests.distributed import run_distributed

    messages = run_distributed(_bad_inputs, world_size=4)[0]
    assert "world size 4 is not divisible by tensor-model-parallel-size 3" in messages[0]
    assert "pipeline-model-parallel-size 3 = 6" in messages[1]
    assert "needs pipeline-model-parallel-size > 1" in messages[2]
    assert "must be >= 1" in messages[3]
    assert "not initialized; call parallel_state.initialize_model_parallel" in messages[4]
    assert "already initialized" in messages[5]
    assert "virtual pipeline parallelism is not enabled" in messages[6]


def test_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ps.initialize_model_parallel(1, 1)


def test_rank_layout_tensor_and_data_group():
    layout = ps.rank_layout(8, 2, 2)
    assert layout["tensor_and_data"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout["position_embedding"] == [[0], [1], [2], [3]]


def test_rank_layout_tensor_and_context_groups():
    """The ranks splitting one micro batch's tokens (TP x CP), and with the DP replicas every
    rank of a stage: the MoE router sums its token counts over them."""
    layout = ps.rank_layout(16, 2, 2, 2)  # TP 2, PP 2, CP 2: DP 2
    assert layout["tensor_and_context"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                            [12, 13, 14, 15]]
    assert layout["tensor_and_data_with_context"] == [list(range(8)), list(range(8, 16))]
    assert ps.rank_layout(8, 2, 2)["tensor_and_context"] == ps.rank_layout(8, 2, 2)["tensor"]


def _lazy_gloo_copy_and_timeouts():
    """On a pretended nccl job: which groups initialize_model_parallel and the gloo accessor
    create, with which backend and timeout."""
    import datetime
    from unittest import mock

    from megatron.core import device

    created = []
    real_new_group = dist.new_group

    def recording_new_group(ranks=None, timeout=None, backend=None, **kwargs):
        created.append((list(ranks), backend, timeout))
        return real_new_group(ranks, timeout=timeout, backend=backend, **kwargs)

    result = {}
    with mock.patch.object(dist, "new_group", recording_new_group), \
            mock.patch.object(device, "dist_backend", lambda: "nccl"):
        ps.initialize_model_parallel(2, 1, distributed_timeout_minutes=7)
        result["at_init"] = list(created)
        result["timeout"] = ps.get_distributed_timeout()
        first = ps.get_data_parallel_group(with_gloo=True)
        second = ps.get_data_parallel_group(with_gloo=True)
        result["made_by_accessor"] = created[len(result["at_init"]):]
        result["same_copy"] = first is second
        result["distinct_from_dp"] = first is not ps.get_data_parallel_group()
        result["copy_ranks"] = dist.get_process_group_ranks(first)
        result["copy_works"] = _all_reduce_one(first)
    ps.destroy_model_parallel()
    # On a gloo job the DP group already is a gloo group: no copy at all.
    ps.initialize_model_parallel(2, 1)
    result["gloo_job_copy_is_dp"] = \
        ps.get_data_parallel_group(with_gloo=True) is ps.get_data_parallel_group()
    return result


def _all_reduce_one(group):
    import torch

    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item()


def test_gloo_copy_of_dp_group_is_made_on_first_use_and_every_group_has_the_timeout():
    import datetime

    from tests.distributed import run_distributed

    results = run_distributed(_lazy_gloo_copy_and_timeouts, world_size=4)
    minutes7 = datetime.timedelta(minutes=7)
    for rank, r in enumerate(results):
        assert all(backend is None for _, backend, _ in r["at_init"]), r["at_init"]
        assert r["at_init"] and all(timeout == minutes7 for _, _, timeout in r["at_init"])
        assert r["timeout"] == minutes7
        # TP=2 on 4 ranks: DP groups [0, 2] and [1, 3]; every rank creates both copies.
        assert r["made_by_accessor"] == [([0, 2], "gloo", minutes7), ([1, 3], "gloo", minutes7)]
        assert r["same_copy"] and r["distinct_from_dp"]
        assert r["copy_ranks"] == [rank % 2, rank % 2 + 2]
        assert r["copy_works"] == 2.0
        assert r["gloo_job_copy_is_dp"]


# (TP, CP, PP) on 8 ranks: global = t + c * TP + d * TP * CP + p * TP * CP * DP.
EXPECTED_CP = {
    (2, 2, 1): dict(
        tensor=[[0, 1], [2, 3], [4, 5], [6, 7]],
        context=[[0, 2], [1, 3], [4, 6], [5, 7]],
        data=[[0, 4], [1, 5], [2, 6], [3, 7]],
        data_with_context=[[0, 2, 4, 6], [1, 3, 5, 7]],
        pipeline=[[0], [1], [2], [3], [4], [5], [6], [7]],
        model=[[0, 1], [2, 3], [4, 5], [6, 7]],
    ),
    (1, 2, 2): dict(
        tensor=[[0], [1], [2], [3], [4], [5], [6], [7]],
        context=[[0, 1], [2, 3], [4, 5], [6, 7]],
        data=[[0, 2], [1, 3], [4, 6], [5, 7]],
        data_with_context=[[0, 1, 2, 3], [4, 5, 6, 7]],
        pipeline=[[0, 4], [1, 5], [2, 6], [3, 7]],
        model=[[0, 4], [1, 5], [2, 6], [3, 7]],
    ),
    (2, 4, 1): dict(
        tensor=[[0, 1], [2, 3], [4, 5], [6, 7]],
        context=[[0, 2, 4, 6], [1, 3, 5, 7]],
        data=[[0], [1], [2], [3], [4], [5], [6], [7]],
        data_with_context=[[0, 2, 4, 6], [1, 3, 5, 7]],
        pipeline=[[0], [1], [2], [3], [4], [5], [6], [7]],
        model=[[0, 1], [2, 3], [4, 5], [6, 7]],
    ),
}

CP_GETTERS = {
    "tensor": ps.get_tensor_model_parallel_group,
    "context": ps.get_context_parallel_group,
    "data": ps.get_data_parallel_group,
    "data_with_context": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "pipeline": ps.get_pipeline_model_parallel_group,
    "model": ps.get_model_parallel_group,
}


def _check_context_parallel_layouts():
    me = dist.get_rank()
    errors = []
    for (tp, cp, pp), expected in EXPECTED_CP.items():
        ps.initialize_model_parallel(tp, pp, context_parallel_size=cp)
        where = f"TP={tp} CP={cp} PP={pp}"
        got = {kind: _ranks_of(getter()) for kind, getter in CP_GETTERS.items()}
        cp_ranks = _mine(expected["context"], me)
        dcp_ranks = _mine(expected["data_with_context"], me)
        got["queries"] = (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                          ps.get_context_parallel_ranks(),
                          ps.get_data_parallel_world_size(with_context_parallel=True),
                          ps.get_data_parallel_rank(with_context_parallel=True),
                          ps.get_data_parallel_ranks(with_context_parallel=True),
                          _ranks_of(ps.get_data_parallel_group(with_gloo=True,
                                                               with_context_parallel=True)))
        want = {kind: _mine(groups, me) for kind, groups in expected.items()}
        want["queries"] = (cp, cp_ranks.index(me), cp_ranks, len(dcp_ranks),
                           dcp_ranks.index(me), dcp_ranks, dcp_ranks)
        if got != want:
            errors.append(f"rank {me} {where}: got {got}, expected {want}")
        ps.destroy_model_parallel()
    return errors


def test_context_parallel_groups_match_hand_written_layouts_on_8_ranks():
    from tests.distributed import run_distributed

    errors = sum(run_distributed(_check_context_parallel_layouts, world_size=8), [])
    assert errors == []


def _world_not_divisible_by_context_parallel():
    try:
        ps.initialize_model_parallel(1, 1, context_parallel_size=3)
    except RuntimeError as exc:
        return str(exc)
    finally:
        ps.destroy_model_parallel()


def test_world_size_not_divisible_by_context_parallel_is_a_clear_error():
    from tests.distributed import run_distributed

    message = run_distributed(_world_not_divisible_by_context_parallel, world_size=4)[0]
    assert message == ("world size 4 is not divisible by tensor-model-parallel-size 1 x "
                       "context-parallel-size 3 x pipeline-model-parallel-size 1 = 3; choose "
                       "sizes whose product divides the number of processes.")
