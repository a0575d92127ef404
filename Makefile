# Wrappers over CMake. `make demo` and `make test` install missing Debian packages first.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: all deps demo test asan clean

all:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

deps:
	bash scripts/install-deps.sh

demo: deps all
	./$(BUILD)/mlp_amp
	./$(BUILD)/linear_walkthrough

test: deps all
	cd $(BUILD) && ctest --output-on-failure -j 2

# The suite under AddressSanitizer + UndefinedBehaviorSanitizer (as CI runs it).
asan: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DAMPC_SANITIZE=ON >/dev/null
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j 2

clean:
	rm -rf build build-asan
