import re, subprocess, sys, tempfile, collections
from pathlib import Path
import triton
from aotattn.compiler import jobs
from aotattn.compiler.jobs import Job
from aotattn.spec import Config, Functional
from aotattn import families
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
table, extra = sys.argv[1], sys.argv[2]
spec = families.kernels()[table]
f = dict(dtype="bf16", BLOCK_D=128, BLOCK_DV=128, PAD_HEAD=True, MASK=0, VARLEN=False, DROPOUT=False, BIAS=0)
names = [n for n, _ in spec.functionals]
if "ATOMIC_DQ" in names: f["ATOMIC_DQ"] = True
cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2) if table != "flash.attn_bwd_preprocess" else dict(BLOCK_M=128, num_warps=4, num_stages=1)
job = Job("sm_90", table, Functional.of(f), Config.of(cfg) if hasattr(Config, "of") else Config(cfg))
orig = jobs._triton_inputs
def patched(job):
    fn, sig, ce, attrs, opt = orig(job)
    if extra != "none":
        attrs = {}
        for i, a in enumerate(spec.arguments):
            if a.aligned or (extra == "hd" and a.name in ("head_dim", "head_dim_v")):
                attrs[(i,)] = [["tt.divisibility", 16 if a.type.startswith("*") else 8]]
    return fn, sig, ce, attrs, opt
jobs._triton_inputs = patched
entry, cubin = jobs.compile_job(job)
with tempfile.NamedTemporaryFile(suffix=".cubin") as t:
    t.write(cubin); t.flush()
    sass = subprocess.run([CUOBJDUMP, "-sass", t.name], capture_output=True, text=True).stdout
c = collections.Counter(m.group(1) for m in re.finditer(r"\b(LDG\S*|LDGSTS\S*|STG\S*|UTMALDG\S*)", sass))
print(table, extra, dict(c))
