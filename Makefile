# Wrappers over CMake. `make demo` and `make test` install missing Debian packages first.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: all deps demo test test-long asan clean fuzz fuzz-corpus install

all:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

deps:
	bash scripts/install-deps.sh

# The default cnn on Fashion-MNIST for one epoch in fp32 and one under bf16 autocast, side by
# side (time, samples/s, peak memory, test accuracy; outputs in a new runs/<date>-<time>/{fp32,amp},
# runs/latest pointing at it). Builds
# ampc-train alone, its log in $(BUILD)/demo-build.log (the tail of it on a failure), and ends on
# the comparison table.
demo: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	@echo "building ampc-train (log: $(BUILD)/demo-build.log) ..."
	@cmake --build $(BUILD) -j $(JOBS) --target ampc-train >$(BUILD)/demo-build.log 2>&1 || { tail -n 30 $(BUILD)/demo-build.log; exit 1; }
	./$(BUILD)/ampc-train --compare --epochs 1

# Every module's tests, without the long end-to-end runs (about 5 minutes with the build on 2
# cores); test-long runs those (ampc-train end to end: training, resume, crashes, bad input,
# several processes), as CI does.
test: deps all
	cd $(BUILD) && ctest --output-on-failure -j 2 -LE long

test-long: deps all
	cd $(BUILD) && ctest --output-on-failure -j 2 -L long

# Builds, then installs the headers, libampc.so/.a, the CMake package (find_package(ampc)), ampc.pc
# and ampc-train into PREFIX: `make install PREFIX=$HOME/.local`.
PREFIX ?= /usr/local
install: all
	cmake --install $(BUILD) --prefix $(PREFIX)

# The suite under AddressSanitizer + UndefinedBehaviorSanitizer (as CI runs it).
asan: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DAMPC_SANITIZE=ON >/dev/null
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j 2

# libFuzzer (tests/fuzz/README.md): clang 14 builds the harnesses in build-fuzz, then each runs
# FUZZ_SECONDS (scripts/fuzz.sh); a crash, leak, timeout or sanitizer report fails the target and
# its input is left in build-fuzz/fuzz-artifacts/<reader>/. The committed corpora are only read.
FUZZ_SECONDS ?= 60
fuzz:
	bash scripts/install-deps.sh fuzz
	CC=clang-14 cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Release -DAMPC_FUZZ=ON >/dev/null
	cmake --build build-fuzz -j $(JOBS) --target fuzz_harnesses
	bash scripts/fuzz.sh build-fuzz $(FUZZ_SECONDS)

# Rewrites the seed corpora tests/fuzz/corpus/ from tests/fuzz/make_corpus.c (commit the result).
fuzz-corpus: all
	rm -rf tests/fuzz/corpus
	./$(BUILD)/fuzz_make_corpus tests/fuzz/corpus

clean:
	rm -rf build build-asan build-fuzz

# Benchmarks (bench/RESULTS.md). BENCH_ARGS / PEER_ARGS pass options, e.g.
#   make bench BENCH_ARGS="--workloads resnet18 --steps 20"
#   make bench-peer PEER_ARGS="--workloads resnet50 --repeat 3"
# bench-peer runs ampc-bench and PyTorch (Debian's python3-torch) config by config, one table.
PEER_PYTHON ?= /usr/bin/python3
.PHONY: bench bench-peer
bench: all
	./$(BUILD)/ampc-bench $(BENCH_ARGS)

bench-peer: all
	$(PEER_PYTHON) bench/pytorch_peer.py --compare --ampc-bench ./$(BUILD)/ampc-bench --openblas-dir $(BUILD)/peer-openblas $(PEER_ARGS)
