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
	@echo "make: [deps] the Debian packages the engine needs (tools/install-deps.sh installs any that are missing)"
	@tools/install-deps.sh

# ENGINE_WERROR=1 (set by .ci/run): compiler warnings are errors in every build
ENGINE_WERROR ?= 0
WERROR_FLAG = -DENGINE_WERROR=$(if $(filter 1,$(ENGINE_WERROR)),ON,OFF)

$(BUILD)/Makefile: CMakeLists.txt
	@echo "make: [build] configuring $(BUILD)/ (cmake, Release; $(BUILD)/configure.log)"
	@mkdir -p $(BUILD)
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(WERROR_FLAG) > $(BUILD)/configure.log 2>&1 || (cat $(BUILD)/configure.log; exit 1)

# $(call cmake_build,DIR,PATTERN): cmake --build DIR, its whole output in DIR/build.log; shown as it comes: cmake's
# progress lines ("[ 42%] Building C object ...", "[ 92%] Built target engine") and the lines matching PATTERN (the
# errors, and for the main build the warnings).  A failed build fails, with the log's last lines (a compile error
# must not leave an old binary to be tested).  (The exit status of cmake goes through DIR/build.rc: /bin/sh has no
# pipefail.)
define cmake_build
{ cmake --build $(1) -j 2 2>&1; echo $$? > $(1)/build.rc; } | tee $(1)/build.log | \
  grep --line-buffered -E '^\[ *[0-9]+%\]|$(2)'; rc=$$(cat $(1)/build.rc); \
  if [ "$$rc" != 0 ]; then echo "--- the last lines of $(1)/build.log:"; tail -n 30 $(1)/build.log; \
  echo "make: the build of $(1)/ failed (rc $$rc; $(1)/build.log)"; exit 1; fi
endef

build: deps $(BUILD)/Makefile
	@echo "make: [build] $(BUILD)/ (Release; a few minutes the first time), the whole output in $(BUILD)/build.log"
	@$(call cmake_build,$(BUILD),error:|warning:|Error [0-9])
	@test -x $(BUILD)/engine

# (make run ARGS="--tokenizer=data/tokenizers/kjv-bpe-4k/tokenizer.json": the KJV shards of that tokenizer too)
TOKENIZER = $(patsubst --tokenizer=%,%,$(filter --tokenizer=%,$(ARGS)))
data: build
	@echo "make: [data] the KJV token shards data/kjv_*.bin (tools/prepare_data.lua; kept when they are there and valid)"
	@$(BUILD)/engine tools/prepare_data.lua
	@$(if $(TOKENIZER),$(BUILD)/engine tools/prepare_data.lua --tokenizer=$(TOKENIZER))

run: build data
	@echo "make: [run] $(RECIPE_FILE) on $(NP) rank(s), into its run folder (runs/<recipe>-<date>-<time>/ unless --out)"
	$(MPIRUN) -np $(NP) $(BUILD)/engine $(RECIPE_FILE) $(ARGS)

# the loss/throughput curves of run folders: make plot RUNS="runs/a runs/b" (default: the newest run in runs/)
RUNS ?= $(shell ls -dt runs/*/ 2>/dev/null | head -n 1)
plot: build
	@if [ -z "$(RUNS)" ]; then echo "make plot: no run folder (RUNS=\"runs/a runs/b\")"; exit 2; fi
	@$(BUILD)/engine tools/plot.lua $(RUNS) $(PLOT_ARGS)

# (data: the README's examples, which spec/readme_spec.lua runs, train on data/kjv_{train,val}.bin)
test: build data asan-build fuzz-build
	@tools/run-tests.sh $(BUILD) --sanitize $(ASAN_BUILD) --fuzz $(FUZZ_BUILD)

# ASan+UBSan build of the library, host and C tests (CPU only)
$(ASAN_BUILD)/Makefile: CMakeLists.txt
	@mkdir -p $(ASAN_BUILD)
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DENGINE_SANITIZE=ON -DENABLE_CUDA=OFF $(WERROR_FLAG) \
	  > $(ASAN_BUILD)/configure.log 2>&1 || (cat $(ASAN_BUILD)/configure.log; exit 1)

asan-build: deps $(ASAN_BUILD)/Makefile
	@echo "make: [asan-build] $(ASAN_BUILD)/ (Debug, ASan+UBSan, CPU only), the whole output in $(ASAN_BUILD)/build.log"
	@$(call cmake_build,$(ASAN_BUILD),error:|Error [0-9])
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
	  echo "make: [fuzz-build] $(FUZZ_BUILD)/ (clang, libFuzzer), the whole output in $(FUZZ_BUILD)/build.log" && \
	  { $(call cmake_build,$(FUZZ_BUILD),error:|Error [0-9]); }; fi

# Each fuzz target for FUZZ_SECONDS (default 60), one after the other, its corpus kept in $(FUZZ_BUILD)/corpus
fuzz: fuzz-build
	@tools/fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS)

sanitize: asan-build
	@tools/run-sanitized.sh $(ASAN_BUILD)

bench: build
	@tools/bench.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
