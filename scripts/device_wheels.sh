#!/usr/bin/env bash
# The pure-Python packages jaxloop needs that the GPU machine's image lacks (ml_collections,
# tensorboardX), downloaded here into .whl/ (ignored by git) for `device_suite.sh`, which
# installs them there. Run once from the repository root before carrying .whl.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
for pkg in ml_collections==1.1.0 tensorboardX==2.6.5; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform any -d .whl "$pkg"
done
ls -l .whl
