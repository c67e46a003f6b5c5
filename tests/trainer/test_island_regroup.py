"""A process that led an island whose teardown could not reset torch's group counter still joins
the next island under the name its fresh followers use (found on the sites harness: a pool
process re-placed as rank 0 waited under group "1" while its new follower waited under "0")."""
from __future__ import annotations

import socket

import torch.distributed as dist

from trainer.island import init_rank, teardown


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_new_world_starts_from_group_zero_whatever_the_last_one_left():
    dist.distributed_c10d._world.group_count = 3  # what a failed destroy leaves behind
    store = dist.TCPStore("127.0.0.1", _port(), 1, is_master=True)
    try:
        init_rank(0, 1, store=store)
        assert dist.distributed_c10d._get_default_group().group_name == "0"
    finally:
        teardown()
