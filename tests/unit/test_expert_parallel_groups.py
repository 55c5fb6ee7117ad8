"""Expert groups against layouts written out by hand (Megatron-Core's expert order:
global = etp_rank + ep_rank * ETP + edp_rank * ETP * EP + pp_rank * ETP * EP * EDP)."""
import pytest
import torch.distributed as dist

from megatron.core import parallel_state as ps

S8 = [[r] for r in range(8)]
# (world, PP, EP, ETP) -> every group of each kind, literally.
EXPECTED = {
    (8, 1, 2, 1): dict(
        expert_tensor=S8,
        expert_model=[[0, 1], [2, 3], [4, 5], [6, 7]],
        expert_data=[[0, 2, 4, 6], [1, 3, 5, 7]],
        expert_tensor_and_model=[[0, 1], [2, 3], [4, 5], [6, 7]],
        expert_tensor_model_pipeline=[[0, 1], [2, 3], [4, 5], [6, 7]],
    ),
    (8, 1, 4, 1): dict(
        expert_tensor=S8,
        expert_model=[[0, 1, 2, 3], [4, 5, 6, 7]],
        expert_data=[[0, 4], [1, 5], [2, 6], [3, 7]],
        expert_tensor_and_model=[[0, 1, 2, 3], [4, 5, 6, 7]],
        expert_tensor_model_pipeline=[[0, 1, 2, 3], [4, 5, 6, 7]],
    ),
    (8, 2, 2, 1): dict(
        expert_tensor=S8,
        expert_model=[[0, 1], [2, 3], [4, 5], [6, 7]],
        expert_data=[[0, 2], [1, 3], [4, 6], [5, 7]],
        expert_tensor_and_model=[[0, 1], [2, 3], [4, 5], [6, 7]],
        expert_tensor_model_pipeline=[[0, 1, 4, 5], [2, 3, 6, 7]],
    ),
    (8, 2, 2, 2): dict(
        expert_tensor=[[0, 1], [2, 3], [4, 5], [6, 7]],
        expert_model=[[0, 2], [1, 3], [4, 6], [5, 7]],
        expert_data=S8,
        expert_tensor_and_model=[[0, 1, 2, 3], [4, 5, 6, 7]],
        expert_tensor_model_pipeline=[[0, 1, 2, 3, 4, 5, 6, 7]],
    ),
    (8, 1, 2, 4): dict(
        expert_tensor=[[0, 1, 2, 3], [4, 5, 6, 7]],
        expert_model=[[0, 4], [1, 5], [2, 6], [3, 7]],
        expert_data=S8,
        expert_tensor_and_model=[[0, 1, 2, 3, 4, 5, 6, 7]],
        expert_tensor_model_pipeline=[[0, 1, 2, 3, 4, 5, 6, 7]],
    ),
    (16, 2, 2, 2): dict(
        expert_tensor=[[2 * i, 2 * i + 1] for i in range(8)],
        expert_model=[[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
        expert_data=[[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
        expert_tensor_and_model=[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        expert_tensor_model_pipeline=[[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]],
    ),
}


@pytest.mark.parametrize("world,pp,ep,etp", sorted(EXPECTED))
def test_expert_layout_matches_hand_written(world, pp, ep, etp):
    assert ps.expert_rank_layout(world, pp, ep, etp) == EXPECTED[(world, pp, ep, etp)]


# (world, TP, CP, PP, EP, ETP): every layout the checks below hold for.
LAYOUTS = [(8, 2, 1, 1, 2, 1), (8, 2, 1, 2, 2, 2), (8, 1, 2, 1, 4, 2), (16, 2, 2, 2, 4, 1),
           (16, 4, 1, 2, 2, 2), (12, 2, 1, 3, 2, 1), (8, 1, 1, 1, 8, 1)]


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp", LAYOUTS)
def test_expert_layout_partitions_each_pipeline_stage(world, tp, cp, pp, ep, etp):
    """ETP x EP x EDP x PP = world; every kind partitions the world; each expert group lies
    in one pipeline stage of the dense layout (experts live beside their dense layers)."""
    layout = ps.expert_rank_layout(world, pp, ep, etp)
    dense = ps.rank_layout(world, tp, pp, cp)
    stage_of = {r: s for s, ranks in enumerate(zip(*dense["pipeline"])) for r in ranks}
    edp = len(layout["expert_data"][0])
    assert etp * ep * edp * pp == world
    sizes = {"expert_tensor": etp, "expert_model": ep, "expert_data": edp,
             "expert_tensor_and_model": etp * ep, "expert_tensor_model_pipeline": etp * ep * pp}
    for kind, groups in layout.items():
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        assert all(len(g) == sizes[kind] for g in groups), kind
        if kind != "expert_tensor_model_pipeline":
            assert all(len({stage_of[r] for r in g}) == 1 for g in groups), kind


@pytest.mark.parametrize("world,tp,cp,pp", [(8, 2, 1, 2), (8, 2, 2, 1), (16, 2, 2, 2)])
def test_ep1_with_etp_equal_tp_is_the_dense_layout(world, tp, cp, pp):
    """Without EP the experts are split like the MLP: expert-TP = TP, expert-DP = DP x CP."""
    layout = ps.expert_rank_layout(world, pp, 1, tp)
    dense = ps.rank_layout(world, tp, pp, cp)
    assert layout["expert_tensor"] == dense["tensor"]
    assert layout["expert_data"] == dense["data_with_context"]
    assert layout["expert_model"] == [[r] for r in range(world)]


def test_expert_sizes_that_do_not_divide_a_stage_are_a_clear_error():
    with pytest.raises(RuntimeError, match=r"expert-model-parallel-size 3 x "
                       r"expert-tensor-parallel-size 1 = 3 does not divide the 8 ranks"):
        ps.expert_rank_layout(8, 1, 3, 1)
    with pytest.raises(RuntimeError, match=r"= 4 does not divide the 2 ranks of a pipeline "
                       r"stage \(tensor x context x data parallel = world size 8 / "
                       r"pipeline-model-parallel-size 4\)"):
        ps.expert_rank_layout(8, 4, 2, 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        ps.expert_rank_layout(8, 1, 0, 1)


def _ranks_of(group):
    return dist.get_process_group_ranks(group)


def _queries():
    return dict(
        ep=(_ranks_of(ps.get_expert_model_parallel_group()),
            ps.get_expert_model_parallel_ranks(), ps.get_expert_model_parallel_world_size(),
            ps.get_expert_model_parallel_rank()),
        etp=(_ranks_of(ps.get_expert_tensor_parallel_group()),
             ps.get_expert_tensor_parallel_ranks(), ps.get_expert_tensor_parallel_world_size(),
             ps.get_expert_tensor_parallel_rank()),
        edp=(_ranks_of(ps.get_expert_data_parallel_group()),
             ps.get_expert_data_parallel_ranks(), ps.get_expert_data_parallel_world_size(),
             ps.get_expert_data_parallel_rank()),
        etp_ep=(_ranks_of(ps.get_expert_tensor_and_model_parallel_group()),
                ps.get_expert_tensor_and_model_parallel_ranks()),
    )


def _groups_on_4_ranks():
    """Three ways to ask for expert groups; the queries each gives, and the errors."""
    got = {}
    ps.initialize_model_parallel(2, 1, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1)
    got["tp2_ep2_etp1"] = _queries()
    ps.destroy_model_parallel()
    assert not ps.expert_parallel_is_initialized()
    ps.initialize_model_parallel(1, 1)
    try:
        ps.get_expert_model_parallel_group()
    except RuntimeError as exc:
        got["not_initialized"] = str(exc)
    ps.initialize_expert_parallel(2)
    got["tp1_ep2"] = _queries()
    try:
        ps.initialize_expert_parallel(2)
    except RuntimeError as exc:
        got["twice"] = str(exc)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 1, expert_model_parallel_size=2)  # ETP defaults to TP
    got["tp2_ep2"] = _queries()
    ps.destroy_model_parallel()
    got["bad"] = _bad_sizes_make_no_group()
    return got


def _bad_sizes_make_no_group():
    from unittest import mock

    made = []
    real_new_group = dist.new_group
    messages = []
    with mock.patch.object(dist, "new_group",
                           lambda *a, **k: made.append(a) or real_new_group(*a, **k)):
        for kwargs in [dict(expert_model_parallel_size=3),
                       dict(expert_model_parallel_size=2, expert_tensor_parallel_size=2)]:
            try:
                ps.initialize_model_parallel(1, 2, **kwargs)
            except RuntimeError as exc:
                messages.append(str(exc))
            ps.destroy_model_parallel()
    return messages, len(made)


def test_expert_groups_and_queries_on_4_ranks():
    from tests.distributed import run_distributed

    results = run_distributed(_groups_on_4_ranks, world_size=4)
    for me, got in enumerate(results):
        pair, other = [me - me % 2, me - me % 2 + 1], [me % 2, me % 2 + 2]
        # TP=2, EP=2, ETP=1: EP pairs neighbours, EDP pairs across.
        assert got["tp2_ep2_etp1"] == dict(ep=(pair, pair, 2, me % 2), etp=([me], [me], 1, 0),
                                           edp=(other, other, 2, me // 2), etp_ep=(pair, pair))
        assert got["tp1_ep2"] == got["tp2_ep2_etp1"]
        # TP=2, EP=2, ETP=2: ETP pairs neighbours, EP pairs across, EDP = 1.
        assert got["tp2_ep2"] == dict(ep=(other, other, 2, me // 2), etp=(pair, pair, 2, me % 2),
                                      edp=([me], [me], 1, 0),
                                      etp_ep=([0, 1, 2, 3], [0, 1, 2, 3]))
        assert "initialize_expert_parallel(...)" in got["not_initialized"]
        assert "already initialized" in got["twice"]
        messages, groups_made = got["bad"]
        assert groups_made == 0  # the sizes are checked before any communication
        assert "= 3 does not divide the 2 ranks of a pipeline stage" in messages[0]
        assert "= 4 does not divide the 2 ranks of a pipeline stage" in messages[1]
