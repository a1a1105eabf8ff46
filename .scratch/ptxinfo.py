import sys, re, subprocess, tempfile, collections
from pathlib import Path
import triton
sys.path.insert(0, '.')
from gluon_fwd import compile_sm90
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
def info(*args, **kw):
    k = compile_sm90(*args, **kw)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as t:
        t.write(k.asm['cubin']); t.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", t.name], capture_output=True, text=True).stdout
    c = collections.Counter(m.group(1) for m in re.finditer(r"\b(LDL\S*|STL\S*|BAR\S*|USETMAXREG\S*)", sass))
    return k, sass, dict(c)
if __name__ == "__main__":
    a = sys.argv[1:]
    k, sass, c = info(int(a[0]), int(a[1]), int(a[2]), bool(int(a[3])), int(a[4]), bool(int(a[5])), consumer_regs=int(a[6]))
    open('/tmp/k.sass','w').write(sass); open('/tmp/k.ptx','w').write(k.asm['ptx'])
    print(a, c, k.metadata.shared)
