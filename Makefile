# The two commands of the README:
#   make demo   installs dependencies if missing, builds what the demo needs (the ferry
#               tool and the main example), runs the example under `ferry run`
#   make test   installs dependencies if missing, builds and runs every test, then again
#               built with AddressSanitizer and UndefinedBehaviorSanitizer
BUILD      ?= build
SAN_BUILD  ?= build-san
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
CTEST_ARGS ?=
# CUDA's runtime maps memory where ASan's shadow gap would be.
SAN_ENV    := ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

.PHONY: all deps build demo test test-plain test-san clean

all: build

deps:
	@./scripts/install-deps.sh

$(BUILD)/build.ninja: | deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)

build: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

demo: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target ferry_cli 02_model_parallel
	./examples/run_demo.sh $(BUILD)

test: test-plain test-san

test-plain: build
	ctest --test-dir $(BUILD) -j $(JOBS) --output-on-failure $(CTEST_ARGS)

$(SAN_BUILD)/build.ninja: | deps
	cmake -S . -B $(SAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFERRY_SANITIZE=address,undefined \
	  -DFERRY_BUILD_EXAMPLES=OFF -DFERRY_BUILD_BENCH=OFF $(CMAKE_ARGS)

test-san: deps $(SAN_BUILD)/build.ninja
	cmake --build $(SAN_BUILD) -j $(JOBS)
	$(SAN_ENV) ctest --test-dir $(SAN_BUILD) -j $(JOBS) --output-on-failure -LE install $(CTEST_ARGS)

clean:
	rm -rf $(BUILD) $(SAN_BUILD)
