"""Where do HSTU's target tokens look? Attention weights of candidates over their visible history.

    python scripts/ranking_attention_probe.py runs/x-synth-hstu-selgauc [best|latest]

For each block, the validation candidates' SiLU attention weights (x max_seq_len, mean over heads)
on visible history events of the candidate's own item cluster vs other clusters, on the
previous event vs the rest, the mass on the contextual tokens, and the correlation between the
mass a candidate puts on same-cluster events and the share of its history in that cluster (the
empirical affinity the synthetic generator's labels depend on). Needs an ``item_features``
column whose first feature is the cluster (configs/ranking-synthetic-hstu.yaml).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.nn.functional as F

from recforge.checkpoint import find_checkpoint, load_checkpoint
from recforge.config import load_config
from recforge.jagged.index import positions_in_sequence
from recforge.models.ranking import visible_history
from recforge.ops.hstu_attention import hstu_attention
from recforge.train import ranking


def main() -> None:
    torch.set_num_threads(1)
    run = sys.argv[1]
    cfg = load_config(f"{run}/config.yaml", ["train.device=cpu"])
    s = ranking.setup(cfg)
    load_checkpoint(find_checkpoint(run, sys.argv[2] if len(sys.argv) > 2 else "best"), s.model)
    s.model.eval()
    samples = ranking._samples(s, "valid")
    clusters = s.data.item_features[:, 0]  # cluster feature id per item code
    stats = {b: {"same": [], "other": [], "prev": [], "rest": [], "ctx": [], "mass_same_share": []} for b in range(len(s.model.encoder.blocks))}
    with torch.no_grad():
        for lo in range(0, min(len(samples), 1024), 128):
            batch = ranking._batch(s, samples, torch.arange(lo, min(lo + 128, len(samples))))
            f = batch.features
            x = s.model.prefix(f)
            L = batch.max_seq_len
            pos = positions_in_sequence(batch.seq_offsets, x.shape[0])
            onehot = F.one_hot(pos, L).float()  # (T, L)
            hist, visible, tgt = visible_history(batch.seq_offsets, batch.mask)
            item = f["item_ids"]
            for b, blk in enumerate(s.model.encoder.blocks):
                cfgb = blk.cfg
                _u, _v, q, k = F.silu(blk.uvqk(blk.norm(x))).split(blk.split_sizes, dim=-1)
                T = x.shape[0]
                w = hstu_attention(q.view(T, cfgb.num_heads, cfgb.dqk), k.view(T, cfgb.num_heads, cfgb.dqk),
                                   onehot.unsqueeze(1).expand(T, cfgb.num_heads, L).contiguous(), batch.seq_offsets, L, batch.mask,
                                   scale=1.0 / cfgb.max_seq_len, pos_weights=blk.pos_weights, timestamps=f["timestamps"],
                                   time_weights=blk.time_weights, kernel="pytorch")  # (T, H, L): weight on each in-seq position
                wt = w[tgt].mean(1)  # (N, L) mean over heads
                # weights on history tokens
                hpos = pos[hist]  # (N, Hh)
                wh = torch.gather(wt, 1, hpos)  # (N, Hh)
                same = (clusters[item[hist]] == clusters[item[tgt]].unsqueeze(1)) & visible
                other = (~same) & visible
                cnt = visible.sum(1)
                prev = torch.zeros_like(visible)
                has = cnt > 0
                prev[has, cnt[has] - 1] = True
                st = stats[b]
                st["same"].append(wh[same])
                st["other"].append(wh[other])
                st["prev"].append(wh[prev & visible])
                st["rest"].append(wh[visible & ~prev])
                c = int(batch.mask.num_contextual[0])
                st["ctx"].append(wt[:, :c].sum(1))
                # does total mass on same-cluster items track the share?
                st["mass_same_share"].append(torch.stack([(wh * same).sum(1), same.sum(1) / cnt.clamp(min=1), (wh * visible).sum(1)], 1)[has])
                x = blk(x, batch.seq_offsets, L, batch.mask, f["timestamps"])
    for b, st in stats.items():
        cat = {k: torch.cat(v) for k, v in st.items()}
        m = cat["mass_same_share"]
        corr = np.corrcoef(m[:, 0].numpy(), m[:, 1].numpy())[0, 1]
        print(f"block {b}: mean weight x256 same-cluster {cat['same'].mean()*256:.3f} other {cat['other'].mean()*256:.3f} | previous event {cat['prev'].mean()*256:.3f} rest {cat['rest'].mean()*256:.3f} | contextual mass {cat['ctx'].mean()*256:.3f} | corr(mass on same, share same) {corr:.3f} | total hist mass x256 {m[:,2].mean()*256:.2f}")


if __name__ == "__main__":
    main()
