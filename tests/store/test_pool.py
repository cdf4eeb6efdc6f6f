import pytest
import torch

from moestream.store.pool import SLOT_ALIGN_BYTES, SlotPool
from moestream.store.streams import CpuLink, CudaEvent, make_link


def test_pool_allocates_aligned_slots_once():
    pool = SlotPool(3, 1002)
    stride = pool.data.shape[1]
    assert pool.data.shape[0] == 3 and stride >= 1002 and stride % SLOT_ALIGN_BYTES == 0
    assert pool.nbytes == 3 * stride and pool.data.dtype == torch.uint8
    for i in range(3):
        slot = pool.slot(i)
        assert slot.shape == (1002,) and slot.is_contiguous()
        assert slot.data_ptr() == pool.data.data_ptr() + i * stride
        assert slot[:1000].view(torch.float32).shape == (250,)


def test_slots_do_not_overlap():
    pool = SlotPool(2, 100)
    pool.data.zero_()
    pool.slot(1).fill_(7)
    assert int(pool.slot(0).sum()) == 0 and bool((pool.slot(1) == 7).all())


def test_pool_without_slots_and_bad_indexes():
    assert SlotPool(0, 64).nbytes == 0
    with pytest.raises(IndexError):
        SlotPool(2, 64).slot(2)
    with pytest.raises(ValueError):
        SlotPool(1, 0)


def test_cpu_pool_is_never_pinned_without_asking_and_copy_is_done_at_once():
    pool = SlotPool(2, 64)
    assert not pool.pinned
    pool.slot(0).copy_(torch.arange(64, dtype=torch.uint8))
    link = make_link("cpu")
    assert isinstance(link, CpuLink)
    done = link.copy(pool.slot(1), pool.slot(0))
    assert done.done() and torch.equal(pool.slot(1), pool.slot(0))
    done.wait_on_compute()
    pool.mark_read(0, done)
    pool.wait_reads(0)
    link.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_host_slots_copy_to_device_without_blocking():
    host = SlotPool(2, 1 << 20, "cpu", pin_memory=True)
    device = SlotPool(2, 1 << 20, "cuda")
    assert host.pinned and host.data.is_pinned() and device.data.is_cuda
    gen = torch.Generator().manual_seed(0)
    host.slot(0).copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen))
    done = make_link("cuda").copy(device.slot(1), host.slot(0))
    assert isinstance(done, CudaEvent)
    done.wait_on_compute()
    host.mark_read(0, done)
    host.wait_reads(0)
    assert done.done()
    assert torch.equal(device.slot(1).cpu(), host.slot(0))
    summed = device.slot(1).sum()  # ordered after the copy on the compute stream
    assert int(summed) == int(host.slot(0).sum())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_copy_waits_for_its_slot_s_last_reader_only_and_the_host_for_neither():
    link, host, device = make_link("cuda"), SlotPool(1, 1 << 20, "cpu", pin_memory=True), SlotPool(2, 1 << 20, "cuda")
    host.slot(0).fill_(7)
    torch.cuda._sleep(2_000_000_000)  # about a second of compute on the current stream
    reader = link.compute_event()  # compute that reads device slot 1, issued up to here
    free = link.copy(device.slot(0), host.slot(0))  # nothing read slot 0: it need not wait for compute
    behind = link.copy(device.slot(1), host.slot(0), after=reader)
    assert not reader.done()  # issuing neither copy waited for compute
    free.synchronize()
    assert not reader.done() and not behind.done()  # slot 0's copy ran beside compute; slot 1's waits for it
    behind.wait_on_compute()
    assert int(device.slot(1).sum()) == 7 * (1 << 20)  # compute after the copy sees its bytes
    assert reader.done()


def test_a_pool_remembers_each_slot_s_last_reader_and_last_write():
    pool, link = SlotPool(2, 64), make_link("cpu")
    assert pool.last_read(0) is None and pool.written(1) is None
    read, written = link.compute_event(), link.copy(pool.slot(1), pool.slot(0))
    pool.mark_read(0, read)
    pool.mark_written(1, written)
    assert pool.last_read(0) is read and pool.written(1) is written and pool.last_read(1) is None
    pool.release()
    with pytest.raises(IndexError):
        pool.slot(0)


def test_host_slots_start_at_the_asked_residue_modulo_the_block():
    pool = SlotPool(3, 5000)
    assert pool.data.data_ptr() % 4096 == 0 and pool.data.shape[1] % 4096 == 0
    for i, residue in [(0, 0), (1, 1700), (2, 4095 + 4096 + 1)]:
        slot = pool.slot(i, residue)
        assert slot.shape == (5000,) and slot.data_ptr() % 4096 == residue % 4096
        assert pool.data.data_ptr() + i * pool.data.shape[1] <= slot.data_ptr()
        assert slot.data_ptr() + 5000 <= pool.data.data_ptr() + (i + 1) * pool.data.shape[1]  # within its row
    assert pool.slot(1, 1700) is pool.slot(1, 1700)  # a slot's view is made once per placement
