"""Registers that a running wgmma still reads, overwritten before its wait: found in PTX.

``wgmma.mma_async`` runs asynchronously. PTX leaves it undefined to write the registers
it takes its A operand from (the register-sourced form), or to touch its accumulator
registers with anything but another wgmma, before a ``wgmma.wait_group`` that covers its
group. Triton 3.6 can emit exactly that: in the fused backward, a value selected after
the dK product was written back into the registers that product was reading, and the
H200 computed a wrong dK (benchmarks/RESULTS.md, twelfth session; Triton's issue 9433
is the same family). The build scans every CUDA kernel's PTX for it along every
control-flow path (loops included) and refuses a kernel that has it; Triton's JIT path
(``AOTATTN_MODE=jit``, or ``auto`` without an image) checks each kernel it compiles once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LABEL = re.compile(r"^\s*(\$?[A-Za-z_][\w$]*):")
_BRANCH = re.compile(r"^(?:@!?%\w+\s+)?bra(?:\.uni)?\s+(\$?[\w$]+)$")
_PREDICATE = re.compile(r"^@!?%\w+\s+")
_REGISTER = re.compile(r"%[A-Za-z_][\w]*")
_WAIT = re.compile(r"^wgmma\.wait_group\.sync\.aligned\s+(\d+)$")
_END = re.compile(r"^(ret|exit)\b")
# opcodes whose first operand is not a register they write
_NO_DESTINATION = ("st.", "stmatrix", "red.", "bar.", "barrier", "cp.", "fence", "membar", "prefetch",
                   "wgmma.", "ret", "exit", "bra", "trap", "griddepcontrol", "mbarrier.init", "mbarrier.arrive",
                   "mbarrier.inval", "tensormap", "setmaxnreg", "nanosleep", "pmevent")


class HazardError(RuntimeError):
    """A compiled kernel's PTX overwrites registers an asynchronous wgmma still reads."""


@dataclass(frozen=True)
class Hazard:
    """An instruction that touches a running wgmma's registers before its wait."""

    wgmma_line: int  # 1-based PTX line of the wgmma
    line: int  # 1-based PTX line of the offending instruction
    registers: tuple[str, ...]
    text: str

    def __str__(self) -> str:
        return (f"PTX line {self.line} ({self.text.strip()[:80]}) touches {', '.join(self.registers)} while the "
                f"wgmma of line {self.wgmma_line} may still be using them")


@dataclass(frozen=True)
class _Instruction:
    line: int
    text: str


def _instructions(ptx: str) -> tuple[list[_Instruction], dict[str, int]]:
    """The kernel's instructions in order (inline-asm blocks and several per line split
    out) and each label's index in that list."""
    instructions: list[_Instruction] = []
    labels: dict[str, int] = {}
    for number, raw in enumerate(ptx.splitlines(), start=1):
        text = raw.split("//", 1)[0].strip()
        label = _LABEL.match(text)
        if label and not text.startswith("."):
            labels[label.group(1)] = len(instructions)
            text = text[label.end():].strip()
        for part in text.split(";"):
            part = part.strip()
            while part[:1] in ("{", "}"):
                part = part[1:].strip()
            while part.endswith("}") and part.count("{") < part.count("}"):
                part = part[:-1].strip()
            if part and not part.startswith("."):
                instructions.append(_Instruction(number, part))
    return instructions, labels


def _operands(text: str) -> list[str]:
    """Top-level comma-separated operands after the opcode (brace lists kept whole)."""
    rest = text.split(None, 1)[1] if " " in text or "\t" in text else ""
    out, depth, current = [], 0, ""
    for ch in rest:
        if ch in "{([":
            depth += 1
        elif ch in "})]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        out.append(current.strip())
    return out


def _writes(text: str) -> set[str]:
    body = _PREDICATE.sub("", text)
    opcode = body.split(None, 1)[0]
    if opcode.startswith(_NO_DESTINATION) or opcode == "st":
        return set()
    operands = _operands(body)
    if not operands:
        return set()
    if opcode.startswith("call"):
        first = operands[0]
        return set(_REGISTER.findall(first)) if first.startswith("(") else set()
    return set(_REGISTER.findall(operands[0]))


def _reads(text: str) -> set[str]:
    body = _PREDICATE.sub("", text)
    operands = _operands(body)
    written = _writes(text)
    regs = set()
    for i, operand in enumerate(operands):
        if i == 0 and written:
            continue
        regs.update(_REGISTER.findall(operand))
    return regs


def _successors(instructions: list[_Instruction], labels: dict[str, int], i: int) -> list[int]:
    body = instructions[i].text
    if _END.match(body):
        return []
    branch = _BRANCH.match(body)
    if branch:
        target = labels.get(branch.group(1))
        targets = [target] if target is not None else []
        if body.startswith("@"):
            targets.append(i + 1)
        return [t for t in targets if t < len(instructions)]
    return [i + 1] if i + 1 < len(instructions) else []


def wgmma_hazards(ptx: str) -> list[Hazard]:
    """Every instruction that, on some path after a wgmma and before a wait covering it,
    writes a register the wgmma reads its A operand from, or reads or writes its
    accumulator without being a wgmma itself."""
    instructions, labels = _instructions(ptx)
    found: dict[tuple[int, int], Hazard] = {}
    for start, ins in enumerate(instructions):
        if not ins.text.startswith("wgmma.mma_async"):
            continue
        operands = _operands(ins.text)
        accumulator = set(_REGISTER.findall(operands[0]))
        a_regs = set(_REGISTER.findall(operands[1])) if operands[1].startswith("{") else set()
        # (instruction index, commit groups since the wgmma): a wait_group N covers it
        # once more than N groups were committed after it was issued
        stack = [(i, 0) for i in _successors(instructions, labels, start)]
        seen = set(stack)
        while stack:
            i, commits = stack.pop()
            text = instructions[i].text
            wait = _WAIT.match(text)
            if wait and commits > int(wait.group(1)):
                continue
            if text.startswith("wgmma.commit_group"):
                commits = min(commits + 1, 8)
            elif not text.startswith("wgmma."):
                touched = (_writes(text) & (a_regs | accumulator)) | (_reads(text) & accumulator)
                if touched:
                    key = (ins.line, instructions[i].line)
                    found.setdefault(key, Hazard(ins.line, instructions[i].line, tuple(sorted(touched)), text))
            for nxt in _successors(instructions, labels, i):
                if (nxt, commits) not in seen:
                    seen.add((nxt, commits))
                    stack.append((nxt, commits))
    return sorted(found.values(), key=lambda h: (h.wgmma_line, h.line))


def check(ptx: str, kernel: str) -> None:
    """Raise :class:`HazardError` naming ``kernel`` if its PTX has a wgmma register hazard."""
    hazards = wgmma_hazards(ptx)
    if hazards:  # Triton's output, not a driver limit: the kernel would run and compute wrong numbers
        raise HazardError(f"{kernel}: {len(hazards)} write(s) to registers a running wgmma reads, first: "
                          f"{hazards[0]}; the kernel would compute wrong numbers (change its source, "
                          "aotattn/compiler/ptx_hazards.py)")
