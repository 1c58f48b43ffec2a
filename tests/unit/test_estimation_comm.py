"""The estimator's model of what real communication holds that torch's fake process group does not."""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch
import torch.distributed as dist
from torch.distributed._tools import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.distributed.backend.c10d_compat import reduce_scatter_single
from torchtitan.estimation.fake_trainer import gloo_patches, p2p_works_hold_tensors


@contextlib.contextmanager
def _fake_world(world_size: int = 2):
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _reduce_scatter_peak(patch) -> int:
    inp, out = torch.ones(1 << 16), torch.empty(1 << 15)
    tracker = MemTracker()
    with patch, tracker:
        reduce_scatter_single(out, inp)
    return tracker.get_tracker_snapshot("peak").get(inp.device, {}).get("Total", 0)


def test_gloo_reduce_scatter_holds_an_input_sized_buffer():
    with _fake_world():
        plain, gloo = _reduce_scatter_peak(contextlib.nullcontext()), _reduce_scatter_peak(gloo_patches())
    assert gloo - plain == (1 << 16) * 4  # gloo's own buffer: the whole fp32 input


def _alive_after_send(patch) -> tuple[bool, bool]:
    """Is a sent tensor alive once dropped by its owner (work still held), and once the work is dropped?"""
    with patch:
        tensor = torch.ones(8)
        ref = weakref.ref(tensor)
        work = dist.isend(tensor, dst=1)
        del tensor
        gc.collect()
        with_work = ref() is not None
        work.wait()
        del work
        gc.collect()
        return with_work, ref() is not None


def test_p2p_works_keep_their_tensor_until_released():
    with _fake_world():
        assert _alive_after_send(contextlib.nullcontext()) == (False, False)  # torch's fake work holds nothing
        assert _alive_after_send(p2p_works_hold_tensors()) == (True, False)
        # batch_isend_irecv checks each op against the module's isend/irecv: the patch keeps it working
        with p2p_works_hold_tensors():
            recv = torch.empty(8)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(8), 1), dist.P2POp(dist.irecv, recv, 1)])
            assert len(works) == 2
            for work in works:
                work.wait()
