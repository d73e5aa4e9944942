# masters of the SFT trajectory: step 0 = the released bf16 SmolLM2 (as fp32), step 20 = the SFT's fp32 master
import json, torch
from dataclasses import asdict
from transformers import AutoModelForCausalLM
from faircast_plugins.key import canonical_name
from faircast_plugins.real_model import smollm2_checkpoint
from faircast_plugins.ab.task import task_problems
torch.set_num_threads(1)
base = str(smollm2_checkpoint())
for step, d in ((0, base), (20, "/tmp/staleness/sft-fp32-master")):
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    torch.save({canonical_name(n): p.detach().clone() for n, p in m.named_parameters()},
               f"/tmp/staleness/sft/run.work/masters/step{step}.pt")
    del m
train, heldout = task_problems("word2z", 0, 100)
json.dump({"model": base, "seed": 70, "train": [asdict(p) for p in train[:16]],
           "trajectory": "the SFT warm start of PROTOCOL-4 (20 AdamW steps of 16 at lr 1e-5, fp32, from the released "
                         "bf16 SmolLM2); step 0 = the released checkpoint, step 20 = the SFT's fp32 master"},
          open("/tmp/staleness/sft/run.spec.json", "w"))
print("ok")
