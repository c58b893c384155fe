# cohort: top-level entry points. The README's first lines use `make demo` and `make test`.
BUILD ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps build test demo asan tsan bench clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS)

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 600 -j 1

# The main job: Fashion-MNIST with DistributedDataParallel on 2 ranks (a short
# run of under a minute here, about 90 % accuracy; `--epochs 10` reaches 91.8 %), then
# the 2-rank allreduce benchmark, checked element by element.
DEMO_EPOCHS ?= 5
demo: build
	rm -rf $(BUILD)/demo-ckpt  # a fresh run each time
	$(BUILD)/cohort run --nproc-per-node 2 $(BUILD)/fashion_mnist --epochs $(DEMO_EPOCHS) --checkpoint-dir $(BUILD)/demo-ckpt
	$(BUILD)/cohort run --nproc-per-node 2 $(BUILD)/cohort bench allreduce -b 8 -e 64M -f 8 -c 1

asan:
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 $(MAKE) test BUILD=build-asan BUILD_TYPE=RelWithDebInfo CMAKE_FLAGS=-DCOHORT_SANITIZE=address

tsan:
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 $(MAKE) test BUILD=build-tsan BUILD_TYPE=RelWithDebInfo CMAKE_FLAGS=-DCOHORT_SANITIZE=thread

bench: build
	bench/compare_peers.sh

clean:
	rm -rf build build-asan build-tsan
