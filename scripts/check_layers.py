#!/usr/bin/env python3
"""Checks ferry's layering: every #include "..." in the library folders points down.

ferry is a stack of folders (DESIGN.md, "Layers"); each is one CMake library, and a folder
may include only folders below it. This script reads every `#include "..."` line of the
library folders and fails (exit 1, printing file:line, the include and why) on

  - an include that points up the table below, or sideways to another unit on the same row
    (the transport adapters are one row: an adapter never includes another adapter);
  - inside a transport adapter, an include of its own factory.h from any file but
    factory.cc: the factory builds agents over the transport, so it sits above it;
  - a cycle between units (folders, with each agents/ sub-folder a unit of its own), shown
    as its shortest loop with one include per step;
  - a library folder missing from the table, or README.md's "## Layout" table listing the
    layers in another order than this one.

tests/, examples/, bench/, fuzz/, tools/ and python/ are not checked: they sit on top and may include
anything. An include that names no file of the tree (absl/..., gloo/...) is not ferry's.

  python3 scripts/check_layers.py              # the tree this script is in
  python3 scripts/check_layers.py --root DIR   # another tree
  python3 scripts/check_layers.py --self-test  # plants bad includes in a copy; they must fail

`make check-layers` runs both; `make test-plain` runs it first.
"""

import argparse
import os
import re
import shutil
import sys
import tempfile

# The layers, top to bottom: (units, job). A unit may include units on rows below its own.
# Units on one row are peers and include none of each other. "agents/*" is every agents/
# sub-folder but agents/core: the transport adapters. README.md's "## Layout" lists the
# same rows in the same order.
LAYERS = [
    (["rpc"], "the public API: init_rpc, rpc_sync/rpc_async, shutdown, the function registry, RRefs"),
    (["backends"], "the backend registry and the built-in backends (options + init handler)"),
    (["agents/*"], "transport adapters (ring, tcp, tensorpipe, process_group, inproc): peers"),
    (["agents/core"], "the agent core: links, handshake, server, liveness, join barrier, transport registry"),
    (["agents"], "agents/*.h: the RpcAgent interface"),
    (["stats", "metrics", "trace"], "call statistics, the metrics endpoint (its record in the store), call traces"),
    (["device_maps"], "device maps, their validation, reverse maps, device lists"),
    (["process_group"], "ProcessGroup over Gloo: collectives, send/recv, sub-groups"),
    (["rendezvous"], "rendezvous(url) handlers and the elastic API"),
    (["store"], "Store: TCPStore, FileStore, HashStore, PrefixStore"),
    (["torch"], "optional: at::Tensor as a wire type (FERRY_WITH_TORCH)"),
    (["serialization"], "Message, archives with a tensor table, error payloads"),
    (["dlpack"], "Tensor to and from DLPack without a copy"),
    (["tensor"], "Device, DType, Tensor, the CUDA runtime interface"),
    (["base"], "Status conventions, logging, futures, threads, environment"),
]

# Top-level folders that are not libraries: ON_TOP sits above every layer (a library never
# includes it), the rest holds no C++.
ON_TOP = {"tests", "examples", "bench", "fuzz", "tools", "python"}
UNCHECKED = ON_TOP | {"docs", "cmake", "scripts"}
SOURCE = re.compile(r"\.(h|hh|hpp|c|cc|cpp|cu|cuh|inc)$")
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def row_of(unit):
    """The row index of `unit` in LAYERS, or None when the table lacks it."""
    if unit.startswith("agents/") and unit != "agents/core":
        unit = "agents/*"
    for index, (units, _) in enumerate(LAYERS):
        if unit in units:
            return index
    return None


def unit_of(path):
    """The unit of a path relative to the root: its top-level folder, agents/<sub> for agents/."""
    parts = path.split("/")
    if parts[0] == "agents" and len(parts) > 2:
        return "agents/" + parts[1]
    return parts[0]


def is_adapter(unit):
    return unit.startswith("agents/") and unit != "agents/core"


def library_folders(root):
    for name in sorted(os.listdir(root)):
        if name.startswith(".") or name.startswith("build") or name in UNCHECKED:
            continue
        if os.path.isdir(os.path.join(root, name)):
            yield name


def sources(root):
    """Every source file of the library folders, relative to `root`."""
    for folder in library_folders(root):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, folder)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not d.startswith("build"))
            for filename in sorted(filenames):
                if SOURCE.search(filename):
                    yield os.path.relpath(os.path.join(dirpath, filename), root).replace(os.sep, "/")


def includes(root, path):
    """(line number, as written, the file it names relative to root) for each ferry include."""
    with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            match = INCLUDE.match(line)
            if not match:
                continue
            written = match.group(1)
            # Written from the root (house style), else next to the including file.
            for candidate in (written, os.path.join(os.path.dirname(path), written)):
                candidate = os.path.normpath(candidate).replace(os.sep, "/")
                if not candidate.startswith("..") and os.path.isfile(os.path.join(root, candidate)):
                    yield number, written, candidate
                    break


def describe(unit):
    return f"{unit} (layer {row_of(unit) + 1})"


def cycles(edges):
    """The strongly connected components of more than one unit (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(unit):
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        on_stack.add(unit)
        for target in sorted(edges.get(unit, {})):
            if target not in index:
                visit(target)
                low[unit] = min(low[unit], low[target])
            elif target in on_stack:
                low[unit] = min(low[unit], index[target])
        if low[unit] == index[unit]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == unit:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for unit in sorted(edges):
        if unit not in index:
            visit(unit)
    return found


def shortest_loop(edges, component):
    """The shortest path from the component's first unit back to itself, inside the component."""
    start, members = component[0], set(component)
    came_from, frontier = {}, [start]
    while frontier:
        following = []
        for unit in frontier:
            for target in sorted(edges.get(unit, {})):
                if target not in members or target in came_from:
                    continue
                came_from[target] = unit
                if target == start:
                    path = [start]
                    while True:
                        path.append(came_from[path[-1]])
                        if path[-1] == start:
                            return path[::-1]
                following.append(target)
        frontier = following
    return [start, start]  # unreachable for a strongly connected component


def readme_order(root):
    """The layered folders in README.md's "## Layout" table, top to bottom (rows naming none skipped)."""
    path = os.path.join(root, "README.md")
    if not os.path.isfile(path):
        return None
    rows, in_layout = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("## "):
                in_layout = line.strip() == "## Layout"
                continue
            if not in_layout or not line.startswith("|"):
                continue
            cell = line.split("|")[1]
            names = [n.strip("/") for n in re.findall(r"`([^`]+)`", cell)]
            layer_rows = sorted({row_of(n) for n in names if row_of(n) is not None})
            if layer_rows:
                rows.append((layer_rows[0], cell.strip()))
    return rows


def check(root):
    """Every problem found under `root`, as printable lines; none means the layering holds."""
    problems = []
    with_sources = {path.split("/")[0] for path in sources(root)}
    for folder in sorted(with_sources):
        if row_of(folder) is None:
            problems.append(f"{folder}/: a library folder missing from LAYERS in scripts/check_layers.py "
                            "(add its row, and README.md's)")
    edges = {}  # unit -> {unit it includes: the first such include, as file:line}
    for path in sources(root):
        source = unit_of(path)
        if row_of(source) is None:
            continue  # reported above
        for number, written, target_path in includes(root, path):
            target = unit_of(target_path)
            where = f'{path}:{number}: #include "{written}"'
            if target == source:
                if (is_adapter(source) and target_path == f"{source}/factory.h"
                        and os.path.basename(path) not in ("factory.cc", "factory.h")):
                    problems.append(f"{where}: inside {source}, only factory.cc includes factory.h (the factory "
                                    "builds agents over the transport, so it sits above the rest of the folder)")
                continue
            if target in ON_TOP:
                problems.append(f"{where}: points up: {source} is a library, and {target}/ sits above every library")
                continue
            if row_of(target) is None:
                continue
            edges.setdefault(source, {}).setdefault(target, where)
            if row_of(target) < row_of(source):
                problems.append(f"{where}: points up: {describe(source)} includes {describe(target)}")
            elif row_of(target) == row_of(source):
                why = "an adapter never includes another adapter" if is_adapter(source) else "units on one row are peers"
                problems.append(f"{where}: sideways: {source} includes {target}, on the same row ({why})")
    for component in cycles(edges):
        loop = shortest_loop(edges, component)
        links = "; ".join(edges[a][b] for a, b in zip(loop, loop[1:]))
        caught = f" ({len(component)} units in all: {', '.join(component)})" if len(component) > len(loop) - 1 else ""
        problems.append(f"cycle: {' -> '.join(loop)}{caught}: {links}")
    order = readme_order(root)
    if order is not None:
        seen = [row for row, _ in order]
        if seen != sorted(seen) or set(seen) != set(range(len(LAYERS))):
            listed = ", ".join(cell for _, cell in order) or "no layer rows"
            problems.append(f"README.md: the \"## Layout\" table must list every layer, top to bottom, as LAYERS does "
                            f"(it lists {listed})")
    return problems


def copy_tree(root, into):
    """The library folders' sources and README.md of `root`, copied under `into`."""
    for path in sources(root):
        os.makedirs(os.path.dirname(os.path.join(into, path)), exist_ok=True)
        shutil.copyfile(os.path.join(root, path), os.path.join(into, path))
    if os.path.isfile(os.path.join(root, "README.md")):
        shutil.copyfile(os.path.join(root, "README.md"), os.path.join(into, "README.md"))


def self_test(root):
    """Plants bad includes, one at a time, in a copy of the tree: each must be reported."""
    def header_in(tree, folder):
        found = sorted(p for p in sources(tree) if unit_of(p) == folder and p.endswith(".h"))
        if not found:
            raise SystemExit(f"self-test: no header in {folder}/ to include")
        return found[0]

    def source_in(tree, folder):
        found = sorted(p for p in sources(tree) if unit_of(p) == folder)
        if not found:
            raise SystemExit(f"self-test: no source in {folder}/ to plant an include in")
        return found[0]

    failures = 0
    with tempfile.TemporaryDirectory(prefix="check_layers.") as tree:
        copy_tree(root, tree)
        before = set(check(tree))
        adapters = sorted({unit_of(p) for p in sources(tree) if is_adapter(unit_of(p))})
        with_factory = [a for a in adapters if os.path.isfile(os.path.join(tree, a, "factory.h"))]
        if len(adapters) < 2 or not with_factory:
            raise SystemExit("self-test: needs two transport adapters, one with a factory.h")
        builder = with_factory[0]
        other = next(a for a in adapters if a != builder)
        built = sorted(p for p in sources(tree) if unit_of(p) == builder and not os.path.basename(p).startswith("factory"))
        cases = [  # (what, file to plant in, header it includes, a word the report must hold)
            ("an upward include", source_in(tree, "base"), header_in(tree, "rpc"), "points up"),
            ("a cycle between two folders", source_in(tree, "store"), header_in(tree, "rendezvous"), "cycle: "),
            ("an adapter including another", source_in(tree, other), f"{builder}/factory.h", "adapter"),
            ("a transport including its factory", built[0], f"{builder}/factory.h", "only factory.cc"),
            ("a downward include, which is fine", source_in(tree, "rpc"), header_in(tree, "base"), None),
        ]
        for what, planted_in, header, expected in cases:
            path = os.path.join(tree, planted_in)
            with open(path, encoding="utf-8") as f:
                original = f.read()
            with open(path, "w", encoding="utf-8") as f:
                f.write(original + f'\n#include "{header}"\n')
            new = [p for p in check(tree) if p not in before]
            with open(path, "w", encoding="utf-8") as f:
                f.write(original)
            if expected is None:
                ok = not new
            else:
                ok = any(expected in p and (planted_in in p or expected == "cycle: ") for p in new)
            print(f"self-test: {what} ({planted_in} -> {header}): {'ok' if ok else 'FAILED'}")
            for p in new:
                print(f"  reported: {p}")
            failures += 0 if ok else 1
        # README.md's table in another order than LAYERS.
        readme = os.path.join(tree, "README.md")
        if os.path.isfile(readme):
            with open(readme, encoding="utf-8") as f:
                text = f.read()
            swapped = text.replace("| `rpc/`", "| `@@/`").replace("| `base/`", "| `rpc/`").replace("| `@@/`", "| `base/`")
            with open(readme, "w", encoding="utf-8") as f:
                f.write(swapped)
            ok = swapped != text and any("README.md" in p for p in check(tree) if p not in before)
            print(f"self-test: README.md's layers out of order: {'ok' if ok else 'FAILED'}")
            failures += 0 if ok else 1
    print("self-test: " + ("passed" if failures == 0 else f"{failures} case(s) FAILED"))
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the tree to check (default: the one this script is in)")
    parser.add_argument("--self-test", action="store_true", help="check that planted violations are caught")
    args = parser.parse_args()
    if args.self_test:
        return self_test(args.root)
    problems = check(args.root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"check_layers: {len(problems)} problem(s); the layers, top to bottom, are in scripts/check_layers.py")
        return 1
    print(f"check_layers: {sum(1 for _ in sources(args.root))} files, the includes all point down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
