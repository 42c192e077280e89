"""The reduce task's reader (``hybrid_ray.reduce_task``) against a real shuffle master."""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa

from conftest import assert_no_leftovers, base_config


class _CommitsSwapped:
    """A master handle whose first two ``commit`` calls reach the master in reverse order,
    as a remote-tier upload committed after the local segment written next does."""

    def __init__(self, master):
        self._master = master
        self._held = None
        self.swapped = False

    def __getattr__(self, name):
        return getattr(self._master, name)

    @property
    def commit(self):
        outer = self

        class _Commit:
            @staticmethod
            def remote(*args):
                import ray

                if outer._held is None and not outer.swapped:
                    outer._held = args
                    return ray.put(True)  # the writer goes on as if it had been sent
                later = outer._master.commit.remote(*args)
                if outer._held is not None:
                    ray.get(later)
                    earlier, outer._held, outer.swapped = outer._held, None, True
                    return outer._master.commit.remote(*earlier)
                return later

        return _Commit()


def test_a_map_s_rows_come_back_in_written_order_when_its_commits_arrive_out_of_order(
        ray_local, tmp_path):
    """Was: the reader kept a map's segments in the order the master received them. With
    the remote tier a map's upload commits after the local segment written next, so rows
    came back out of order and a seeded ``random_shuffle`` differed run to run."""
    import ray

    from hybrid_ray.actors import get_master
    from hybrid_ray.partitioning import HashPartitioner
    from hybrid_ray.reduce_task import read_subpartition
    from hybrid_ray.shuffle import write_map_partition

    config = base_config(tmp_path, mode="blocking",
                         namespace=f"hr-order-{uuid.uuid4().hex[:6]}",
                         segment_bytes={"memory": 64 * 1024, "disk": 64 * 1024,
                                        "remote": 64 * 1024})
    master = get_master(config.namespace)
    shuffle_id = f"shf-{uuid.uuid4().hex[:12]}"
    ray.get(master.register.remote(shuffle_id, 1, 2, config, True))
    table = pa.table({"key": np.arange(60_000) % 5, "id": np.arange(60_000)})
    swapping = _CommitsSwapped(master)
    try:
        # Three chunks: the first two are committed on their own (swapped here), the
        # last travels with finish_map.
        write_map_partition(shuffle_id, 0, [table.slice(i * 20_000, 20_000) for i in range(3)],
                            2, HashPartitioner(["key"]), config, swapping)
        assert swapping.swapped
        order = [m.id.index for m in ray.get(master.segments.remote(shuffle_id))
                 if m.id.subpartition == 0]
        assert order != sorted(order), "the master must have received them out of order"
        parts = np.asarray(HashPartitioner(["key"]).assign(table, 0, 2))
        for sub in (0, 1):
            rows = pa.concat_tables(read_subpartition(shuffle_id, sub, config, master))
            assert rows["id"].to_pylist() == table["id"].to_numpy()[parts == sub].tolist()
    finally:
        ray.get(master.release.remote(shuffle_id))
    assert_no_leftovers(config, ray)
