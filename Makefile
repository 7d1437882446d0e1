# The two commands of the README:
#   make run   installs what is missing, builds, prepares data, runs the default recipe
#   make test  same set-up, then the whole test suite (last line: N passed, N failed)
BUILD ?= build
NP ?= 1
ARGS ?=
MPIRUN = mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 \
         -x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1073741824

.PHONY: all deps build run test data clean sanitize bench

all: build

deps:
	@tools/install-deps.sh

$(BUILD)/Makefile: CMakeLists.txt
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release > $(BUILD).cmake.log 2>&1 || (cat $(BUILD).cmake.log; exit 1)

build: deps $(BUILD)/Makefile
	@cmake --build $(BUILD) -j 2 2>&1 | grep -E "error:|warning:|Error [0-9]" || true
	@test -x $(BUILD)/engine || (cmake --build $(BUILD) -j 2; exit 1)

data: build
	@$(BUILD)/engine tools/prepare_data.lua

run: build data
	$(MPIRUN) -np $(NP) $(BUILD)/engine recipes/gpt.lua $(ARGS)

test: build
	@tools/run-tests.sh $(BUILD)

sanitize: deps
	@cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DENGINE_SANITIZE=ON -DENABLE_CUDA=OFF > build-asan.cmake.log 2>&1
	@cmake --build build-asan -j 2 >/dev/null
	@tools/run-sanitized.sh build-asan

bench: build
	@$(BUILD)/engine recipes/bench/step.lua

clean:
	rm -rf $(BUILD) build-asan
