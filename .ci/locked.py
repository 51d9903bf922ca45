"""Fails when the environment holds a package the lock does not pin, or at another version.

pip's constraints only pin what the lock names: a dependency added to pyproject.toml without
`bash .ci/lock` would be installed at whatever release is newest. Usage: python .ci/locked.py LOCK
"""

import re
import sys
from importlib import metadata


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(lock: str) -> int:
    pinned = {}
    for line in open(lock):
        m = re.match(r"^([A-Za-z0-9._-]+)==(\S+)", line)
        if m:
            pinned[canonical(m[1])] = m[2]
    wrong = []
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"])
        if name == "mpitrain":
            continue
        if pinned.get(name) != dist.version:
            wrong.append(f"{name}=={dist.version} (lock: {pinned.get(name, 'not pinned')})")
    if wrong:
        print(f"{lock} does not hold what was installed: {', '.join(sorted(wrong))}; "
              "run `bash .ci/lock` and commit the locks", file=sys.stderr)
        return 1
    print(f"=== every installed package is at its version in {lock}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
