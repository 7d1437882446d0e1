# The two commands of the README:
#   make run   installs what is missing, builds, prepares data, runs the default recipe
#   make test  installs and builds (the Release build, an ASan+UBSan build and the fuzz targets), then the
#              whole test suite, its sanitizer stage and a few seconds of each fuzz target
#              (last line: N passed, N failed, N skipped)
BUILD ?= build
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 60
NP ?= 1
ARGS ?=
# RECIPE=gpt (default), tp (recipes/tp_gpt.lua), dp (recipes/dp_gpt.lua), or any recipes/<name>.lua
RECIPE ?= gpt
RECIPE_FILE = $(firstword $(wildcard recipes/$(RECIPE).lua recipes/$(RECIPE)_gpt.lua) recipes/$(RECIPE).lua)
MPIRUN = mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader --mca pml ob1 \
         -x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1073741824

.PHONY: all deps build asan-build fuzz-build fuzz run test data clean sanitize bench plot

all: build

deps:
	@tools/install-deps.sh

# ENGINE_WERROR=1 (set by .ci/run): compiler warnings are errors in every build
ENGINE_WERROR ?= 0
WERROR_FLAG = -DENGINE_WERROR=$(if $(filter 1,$(ENGINE_WERROR)),ON,OFF)

$(BUILD)/Makefile: CMakeLists.txt
	@mkdir -p $(BUILD)
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(WERROR_FLAG) > $(BUILD)/configure.log 2>&1 || (cat $(BUILD)/configure.log; exit 1)

# The build's output goes to $(BUILD)/build.log; errors and warnings are shown, and a failed build fails
# (a compile error must not leave an old binary to be tested).
build: deps $(BUILD)/Makefile
	@cmake --build $(BUILD) -j 2 > $(BUILD)/build.log 2>&1; rc=$$?; \
	  grep -E "error:|warning:|Error [0-9]" $(BUILD)/build.log; \
	  if [ $$rc -ne 0 ]; then tail -n 30 $(BUILD)/build.log; echo "make build: the build failed (rc $$rc; $(BUILD)/build.log)"; exit 1; fi
	@test -x $(BUILD)/engine

# (make run ARGS="--tokenizer=data/tokenizers/kjv-bpe-4k/tokenizer.json": the KJV shards of that tokenizer too)
TOKENIZER = $(patsubst --tokenizer=%,%,$(filter --tokenizer=%,$(ARGS)))
data: build
	@$(BUILD)/engine tools/prepare_data.lua
	@$(if $(TOKENIZER),$(BUILD)/engine tools/prepare_data.lua --tokenizer=$(TOKENIZER))

run: build data
	$(MPIRUN) -np $(NP) $(BUILD)/engine $(RECIPE_FILE) $(ARGS)

# the loss/throughput curves of run folders: make plot RUNS="runs/a runs/b" (default: the newest run in runs/)
RUNS ?= $(lastword $(sort $(wildcard runs/*)))
plot: build
	@if [ -z "$(RUNS)" ]; then echo "make plot: no run folder (RUNS=\"runs/a runs/b\")"; exit 2; fi
	@$(BUILD)/engine tools/plot.lua $(RUNS) $(PLOT_ARGS)

test: build asan-build fuzz-build
	@tools/run-tests.sh $(BUILD) --sanitize $(ASAN_BUILD) --fuzz $(FUZZ_BUILD)

# ASan+UBSan build of the library, host and C tests (CPU only)
$(ASAN_BUILD)/Makefile: CMakeLists.txt
	@mkdir -p $(ASAN_BUILD)
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DENGINE_SANITIZE=ON -DENABLE_CUDA=OFF $(WERROR_FLAG) \
	  > $(ASAN_BUILD)/configure.log 2>&1 || (cat $(ASAN_BUILD)/configure.log; exit 1)

asan-build: deps $(ASAN_BUILD)/Makefile
	@cmake --build $(ASAN_BUILD) -j 2 > $(ASAN_BUILD)/build.log 2>&1; rc=$$?; \
	  grep -E "error:|Error [0-9]" $(ASAN_BUILD)/build.log; \
	  if [ $$rc -ne 0 ]; then tail -n 30 $(ASAN_BUILD)/build.log; echo "make asan-build: the build failed (rc $$rc)"; exit 1; fi
	@test -x $(ASAN_BUILD)/engine

# libFuzzer targets (spec/fuzz): clang, coverage + ASan + UBSan, CPU only.  Without clang or its libFuzzer
# runtime this says so and builds nothing (the test suite then counts the fuzz targets as skipped).
$(FUZZ_BUILD)/Makefile: CMakeLists.txt
	@mkdir -p $(FUZZ_BUILD)
	@CC=clang cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=Debug -DENGINE_FUZZ=ON -DENABLE_CUDA=OFF -DENGINE_NATIVE=OFF \
	  > $(FUZZ_BUILD)/configure.log 2>&1 || (cat $(FUZZ_BUILD)/configure.log; rm -f $(FUZZ_BUILD)/Makefile; exit 1)

fuzz-build: deps
	@if ! command -v clang >/dev/null 2>&1; then echo "fuzz-build: clang not found, fuzz targets not built"; \
	else $(MAKE) --no-print-directory $(FUZZ_BUILD)/Makefile && \
	  { cmake --build $(FUZZ_BUILD) -j 2 > $(FUZZ_BUILD)/build.log 2>&1; rc=$$?; \
	    grep -E "error:|Error [0-9]" $(FUZZ_BUILD)/build.log; \
	    if [ $$rc -ne 0 ]; then tail -n 30 $(FUZZ_BUILD)/build.log; echo "make fuzz-build: the build failed (rc $$rc)"; exit 1; fi; }; fi

# Each fuzz target for FUZZ_SECONDS (default 60), one after the other, its corpus kept in $(FUZZ_BUILD)/corpus
fuzz: fuzz-build
	@tools/fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS)

sanitize: asan-build
	@tools/run-sanitized.sh $(ASAN_BUILD)

bench: build
	@tools/bench.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
