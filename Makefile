# Thin wrapper over CMake carrying the README's commands.
BUILD ?= build
ASAN_BUILD ?= build-asan
JOBS ?= $(shell nproc)

.PHONY: all deps build run test test-asan test-dist bench clean fixtures docs

all: build

deps:
	@scripts/install-deps.sh

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build $(BUILD) -j $(JOBS) -- --no-print-directory

# Train the default small model on the embedded corpus (no download): a BPE vocabulary is trained
# on it, the corpus is tokenized into a .bin/.idx dataset, then the model trains on that.
QS = runs/quickstart-data
run: build
	$(BUILD)/tera tokenizer train --input data/default_corpus.txt --vocab-size 512 --output $(QS)/tokenizer --force
	$(BUILD)/tera data prepare --input data/default_corpus.txt --tokenizer $(QS)/tokenizer --output $(QS)/corpus --force
	$(BUILD)/tera train -c configs/quickstart.ini --logging.run_dir=runs/quickstart --force

# Unit, reference and end-to-end tests, then the same unit tests under ASan/UBSan.
test: build test-asan
	@cd $(BUILD) && ctest --output-on-failure -j 2

test-asan: deps
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DTERA_SANITIZE=ON >/dev/null
	@cmake --build $(ASAN_BUILD) -j $(JOBS) -- --no-print-directory
	@cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j 2 -LE "slow|rss"

# The whole table of parallel layouts against one rank (CI runs a subset inside `make test`), on this
# CPU's own oneDNN kernels and again capped at AVX2, so that a dependence on the CPU shows here.
test-dist: build
	@TERA_TEST_FULL=1 OMP_WAIT_POLICY=PASSIVE bash tests/cli_layouts.sh $(BUILD)/tera $(CURDIR)
	@ONEDNN_MAX_CPU_ISA=AVX2 TERA_TEST_FULL=1 OMP_WAIT_POLICY=PASSIVE bash tests/cli_layouts.sh $(BUILD)/tera $(CURDIR)
	@OMP_WAIT_POLICY=PASSIVE bash tests/cli_dist.sh $(BUILD)/tera $(CURDIR)

# bench-s and bench-m on 1 and 2 threads, tera beside PyTorch eager (needs python3-torch).
bench: build
	@scripts/install-deps.sh --with-torch
	@bench/run.sh $(BUILD)/tera

# Regenerate the committed PyTorch fixtures (needs python3-torch).
fixtures:
	@scripts/install-deps.sh --with-torch
	/usr/bin/python3 tests/ref/make_fixtures.py
	/usr/bin/python3 tests/ref/make_balance_fixtures.py

# Regenerate docs/CONFIG.md from the config key table.
docs: build
	$(BUILD)/tera config --doc > docs/CONFIG.md

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
