"""build_model draws weights from --seed on every rank, then gives back every generator as it
was: the CPU one, the device one (on CUDA, torch.manual_seed reseeds it too) and the
tensor-parallel tracker's streams, so dropout after it is Megatron's seed + 100 * pp_rank."""
import torch

from tests.distributed import run_distributed


def _build_with_cuda_like_device():
    """The device module is pointed at a generator of its own that torch.manual_seed also
    reseeds, as it reseeds CUDA's; the model provider draws from the tracker's stream."""
    from unittest import mock

    from megatron.core import device
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models import LlamaModel
    from megatron.core.tensor_parallel.random import get_rng_tracker, model_parallel_manual_seed
    from megatron.training.training import build_model
    from tests.unit.test_data_parallel import VOCAB, _config

    fake_device = torch.Generator()
    real_manual_seed = torch.manual_seed

    def manual_seed_all(seed):  # torch.manual_seed on a CUDA machine
        fake_device.manual_seed(seed)
        return real_manual_seed(seed)

    config = _config()

    def provider(**stage):
        with get_rng_tracker().fork():  # e.g. a layer drawing on the sharded stream
            torch.rand(4, generator=fake_device)
        return LlamaModel(config, VOCAB, **stage)

    with mock.patch.object(device, "get_rng_state", fake_device.get_state), \
            mock.patch.object(device, "set_rng_state", fake_device.set_state), \
            mock.patch.object(device, "manual_seed", fake_device.manual_seed), \
            mock.patch.object(torch, "manual_seed", manual_seed_all):
        model_parallel_manual_seed(1234)
        torch.rand(3, generator=fake_device)  # a stream that is not at its seed any more
        before = (torch.get_rng_state(), fake_device.get_state(),
                  get_rng_tracker().get_states())
        build_model(provider, config, DistributedDataParallelConfig(), seed=42)
        after = (torch.get_rng_state(), fake_device.get_state(),
                 get_rng_tracker().get_states())
    return {"cpu": torch.equal(before[0], after[0]),
            "device": torch.equal(before[1], after[1]),
            "tracker": before[2].keys() == after[2].keys() and
            all(torch.equal(before[2][k], after[2][k]) for k in before[2])}


def test_build_model_restores_cpu_device_and_tracker_generators():
    (result,) = run_distributed(_build_with_cuda_like_device, world_size=1, tp=1)
    assert result == {"cpu": True, "device": True, "tracker": True}
