# cohort: top-level entry points. The README's first lines use `make demo` and `make test`.
BUILD ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps build test demo asan tsan bench clean

all: build

deps:
	@scripts/install-deps.sh

# LIBTORCH=2.13.0 (any PyTorch release on PyPI): build against that LibTorch,
# installed from PyTorch's CPU wheel by scripts/install-libtorch.sh, in
# build-torch<version>/. Default: Debian's libtorch-dev 1.13 (README "Which LibTorch").
LIBTORCH ?=
ifneq ($(LIBTORCH),)
BUILD := build-torch$(LIBTORCH)
endif

# (An install that fails stops here, rather than configuring without it.)
$(BUILD)/CMakeCache.txt:
	$(if $(LIBTORCH),lt=$$(scripts/install-libtorch.sh $(LIBTORCH)) &&) \
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS) $(if $(LIBTORCH),-DCOHORT_LIBTORCH=$$lt)

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 600 -j 1

# The main job: Fashion-MNIST with DistributedDataParallel on 2 ranks, checkpointing
# every 200 steps (training takes about a minute here, 90.9 % test accuracy;
# `--epochs 10` reaches 91.8 %). Builds only the launcher and the example (about two
# minutes from a fresh clone on 2 cores); `make test` builds the rest. The final test
# accuracy is the last line it prints.
DEMO_EPOCHS ?= 5
demo: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS) --target cohort_cli fashion_mnist
	rm -rf $(BUILD)/demo-ckpt  # a fresh run each time
	$(BUILD)/cohort run --nproc-per-node 2 $(BUILD)/fashion_mnist --epochs $(DEMO_EPOCHS) \
	    --checkpoint-dir $(BUILD)/demo-ckpt --checkpoint-every 200 --keep 2

asan:
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 $(MAKE) test BUILD=build-asan BUILD_TYPE=RelWithDebInfo CMAKE_FLAGS=-DCOHORT_SANITIZE=address

tsan:
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 $(MAKE) test BUILD=build-tsan BUILD_TYPE=RelWithDebInfo CMAKE_FLAGS=-DCOHORT_SANITIZE=thread

bench: build
	bench/compare_peers.sh

clean:
	rm -rf build build-asan build-tsan
