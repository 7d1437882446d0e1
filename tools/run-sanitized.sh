#!/usr/bin/env bash
# Runs the C-level tests and the op specs on an ASan+UBSan build.
# Usage: tools/run-sanitized.sh build-asan
set -u
BUILD=${1:-build-asan}
cd "$(dirname "$0")/.."
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
status=0
for t in "$BUILD"/ctests/*; do "$t" || status=1; done
# LuaJIT itself is not instrumented; preload the ASan runtime for the host.
ASAN_LIB=$(gcc -print-file-name=libasan.so)
LD_PRELOAD="$ASAN_LIB" "$BUILD/engine" "$(command -v busted || echo /usr/bin/busted)" --ignore-lua -o tools/passfail.lua \
  spec/ffi_spec.lua spec/binary_spec.lua spec/pointwise_spec.lua spec/reduce_spec.lua spec/shape_spec.lua \
  spec/matmul_spec.lua spec/softmax_spec.lua spec/loss_spec.lua spec/norm_spec.lua spec/embedding_spec.lua \
  spec/autograd_spec.lua spec/safetensors_spec.lua || status=1
exit $status
