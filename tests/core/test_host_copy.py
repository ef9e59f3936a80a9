"""The host's reads of values it keeps (an optimizer's step counters) and of non-blocking copies."""
import torch

from gradfuse.core.host_copy import HostCopy, is_host_copy, read_host_resident


def test_read_host_resident_reads_counters_of_any_one_element_shape():
    zero_d = [torch.tensor(3.0), torch.tensor(4.0)]
    one_d = [torch.tensor([5.0]), torch.tensor([6.0])]
    mixed = [torch.tensor([7.0]), torch.tensor(8.0, dtype=torch.float64)]  # an old checkpoint's beside a new one
    assert read_host_resident(zero_d) == [3.0, 4.0]
    assert read_host_resident(one_d) == [5.0, 6.0]
    assert read_host_resident(mixed) == [7.0, 8.0]
    assert read_host_resident([torch.tensor(2.0 ** 24 + 2)]) == [2.0 ** 24 + 2]  # float32 counters read exactly


def test_host_copy_of_cpu_tensors_is_marked_as_one():
    copy = HostCopy([torch.tensor(1.5), None])
    value, missing = copy.get()
    assert missing is None and value.item() == 1.5 and is_host_copy(value)
