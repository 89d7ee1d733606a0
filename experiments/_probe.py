import torch, torch.distributed as dist, time, statistics, os
from experiments.calibrate import measure as M
from parallel import comm
dist.init_process_group("gloo")
r = dist.get_rank(); hosts, per = int(os.environ["GROUP_WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
mine = None
for h in range(0, hosts - 1, 2):
    for l in range(per):
        ranks = [h * per + l, (h + 1) * per + l]
        g = dist.new_group(ranks)
        if r in ranks: mine = g
_, inter = M.groups(hosts, per)
res = {}
for mb in (1.0, 3.15, 8.4):
    n = int(mb * 1e6 / 4); shard = torch.randn(n); full = torch.empty(2 * n)
    t = M._seconds(lambda: comm.all_gather_into_tensor(full, shard, group=mine), 5, None)
    res[f"pair allgather {mb} MB each way: MB/s"] = mb / t
bw, a = M.ring_fit(inter)
res["ring_fit inter MB/s"] = bw / 1e6
if r == 0:
    for k, v in res.items(): print(f"{k:40s} {v:.2f}", flush=True)
dist.destroy_process_group()
