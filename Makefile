# dflash: C11 + CUDA tools that train and evaluate DFlash drafters.
#
#   make            libdflash and every tool into bin/ (CUDA when nvcc is found)
#   make check      install missing packages, build, run every test, then again
#                   under ASan+UBSan; ends with "N passed, N failed"
#   make demo       the whole job on a tiny built-in model (under 5 minutes)
#   make bench      throughput beside the PyTorch/lz4/zstd equivalents
#   make fuzz       the libFuzzer targets, FUZZ_SECONDS each
#   make fixtures   remake the golden fixtures (needs torch and transformers)
#   make man        regenerate man/*.1 and man/*.5 from their scdoc sources
#   make install    PREFIX=/usr/local
#   make deps       apt-get the Debian packages that are missing
#
# Knobs: NO_CUDA=1 skips the CUDA part; SAN=1 builds with ASan+UBSan;
# BUILD=dir and BIN=dir move the build; CC=clang works as well as gcc.

PREFIX   ?= /usr/local
BUILD    ?= build
BIN      ?= bin
FUZZ_SECONDS ?= 60
CUDA_ARCH ?= -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90

# msgpack-c is "msgpack-c" from 6.0 on and "msgpack" before (Debian 12).
MSGPACK_PC := $(shell pkg-config --exists msgpack-c 2>/dev/null && echo msgpack-c || echo msgpack)
PKGS     := $(MSGPACK_PC) liblz4 jansson libxxhash
# OpenBLAS built on OpenMP shares our OpenMP thread pool; the pthread build
# would run its own threads beside ours and spin against them (measured: 40%
# of a training step's CPU time in sched_yield and libgomp spinning on 2
# cores). Debian installs the variants side by side; link the OpenMP one by
# path, with an rpath so the loader does not pick the system default.
MULTIARCH  := $(shell $(CC) -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
BLAS_OMP   := /usr/lib/$(MULTIARCH)/openblas-openmp
ifneq ($(wildcard $(BLAS_OMP)/libopenblas.so),)
  BLAS_CFLAGS := -I/usr/include/$(MULTIARCH)/openblas-openmp
  BLAS_LIBS   := -L$(BLAS_OMP) -Wl,-rpath,$(BLAS_OMP) -lopenblas
else
  BLAS_CFLAGS := $(shell pkg-config --cflags openblas 2>/dev/null)
  BLAS_LIBS   := $(shell pkg-config --libs openblas 2>/dev/null)
endif
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null) $(BLAS_CFLAGS)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null) $(BLAS_LIBS)

WARN     := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wno-unused-parameter
CFLAGS   ?= -O2 -g
ALL_CFLAGS := -std=c11 -D_GNU_SOURCE $(WARN) $(CFLAGS) -fopenmp -Ilib $(PKG_CFLAGS)
LDLIBS   := $(PKG_LIBS) -fopenmp -lm

ifeq ($(SAN),1)
  ALL_CFLAGS += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
  LDLIBS += -fsanitize=address,undefined
  NO_CUDA := 1
endif

NVCC := $(if $(NO_CUDA),,$(shell command -v nvcc 2>/dev/null))
ifneq ($(NVCC),)
  CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
  ALL_CFLAGS += -DDFLASH_HAVE_CUDA
  CUDA_LIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lcudart -lstdc++
  NVCCFLAGS ?= -O3 -std=c++17 $(CUDA_ARCH) -lineinfo -Ilib -Ikernels -Xcompiler -Wall,-Wextra,-Werror,-Wno-unused-parameter -Werror all-warnings
  CUDA_STATUS := CUDA backend: building with $(NVCC) for sm_90a (+PTX)
else
  CUDA_STATUS := CUDA backend: skipped ($(if $(NO_CUDA),NO_CUDA=1,nvcc not found)); --device cuda will report it
endif

LIB_SRC    := $(sort $(wildcard lib/*.c))
LIB_OBJ    := $(LIB_SRC:%.c=$(BUILD)/%.o)
KERNEL_SRC := $(if $(NVCC),$(sort $(wildcard kernels/*.cu)))
KERNEL_OBJ := $(KERNEL_SRC:%.cu=$(BUILD)/%.o)
TOOL_SRC   := $(sort $(wildcard tools/dflash-*.c))
TOOLS      := $(TOOL_SRC:tools/%.c=$(BIN)/%)
UNIT_SRC   := $(sort $(wildcard tests/unit/test_*.c))
UNIT_BIN   := $(UNIT_SRC:tests/unit/%.c=$(BUILD)/tests/%)
HELPER_SRC := $(sort $(wildcard tests/helpers/*.c))
HELPER_BIN := $(HELPER_SRC:tests/helpers/%.c=$(BUILD)/tests/%)
GPU_SRC    := $(sort $(wildcard tests/gpu/bench_*.c))
GPU_BIN    := $(GPU_SRC:tests/gpu/%.c=$(BUILD)/gpu/%)
MAN_SRC    := $(sort $(wildcard man/*.scd))
MAN_OUT    := $(MAN_SRC:%.scd=%)

LIBDFLASH  := $(BUILD)/libdflash.a

# Rebuild everything when the flags change (e.g. NO_CUDA=1 after a CUDA build).
FLAGS_STAMP := $(BUILD)/.flags
$(shell mkdir -p $(BUILD); echo '$(CC) $(ALL_CFLAGS) $(NVCC)' | cmp -s - $(FLAGS_STAMP) || echo '$(CC) $(ALL_CFLAGS) $(NVCC)' > $(FLAGS_STAMP))

# The CUDA kernels compiled for the CPU against a CUDA emulation (tests/emu)
# and linked into test_ops_cuda as its "device": the CUDA agreement tests
# then run on every machine (not under SAN: fibers and ASan do not mix).
EMU_CXXFLAGS := -std=c++17 -O2 -g -DDFLASH_EMU -DDFLASH_HAVE_CUDA -Ilib -Ikernels -Itests/emu \
                -Wall -Wextra -Werror -Wno-unused-parameter -Wno-unknown-pragmas -fno-strict-aliasing -U_FORTIFY_SOURCE
EMU_SRC    := $(sort $(wildcard kernels/*.cu)) $(sort $(wildcard tests/emu/*.cpp))
EMU_OBJ    := $(EMU_SRC:%=$(BUILD)/emu/%.o) $(BUILD)/emu/lib/ops.c.o
EMU_TOOLS  := $(TOOL_SRC:tools/%.c=$(BUILD)/emu/bin/%)
EMU_BENCH  := $(BUILD)/gpu/bench_train_emu $(BUILD)/gpu/bench_attn_emu
EMU_TEST   := $(if $(filter 1,$(SAN)),,$(BUILD)/tests/test_ops_cuda_emu $(EMU_BENCH) \
                $(BUILD)/gpu/wgmma_probe_emu $(EMU_TOOLS))

.PHONY: all check check-build test deps demo bench fuzz fixtures man install clean status gpu-check
.DEFAULT_GOAL := all

all: status $(TOOLS)

status:
	@echo "$(CUDA_STATUS)"

$(BUILD)/lib/%.o: lib/%.c $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/kernels/%.o: kernels/%.cu $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(LIBDFLASH): $(LIB_OBJ) $(KERNEL_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BIN)/%: tools/%.c $(LIBDFLASH) $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -MMD -MP -MF $(BUILD)/tools/$*.d $< $(LIBDFLASH) $(CUDA_LIBS) $(LDLIBS) -o $@
$(TOOLS): | $(BUILD)/tools
$(BUILD)/tools:
	@mkdir -p $@

$(BUILD)/tests/%: tests/unit/%.c tests/test.h $(LIBDFLASH) $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -MMD -MP -MF $@.d -Itests $< $(LIBDFLASH) $(CUDA_LIBS) $(LDLIBS) -o $@

$(BUILD)/tests/%: tests/helpers/%.c $(LIBDFLASH) $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -Itests $< $(LIBDFLASH) $(CUDA_LIBS) $(LDLIBS) -o $@

# GPU benchmarks (tests/gpu/run.sh runs them; CI only builds them, and
# smoke-tests them on the CPU with --tiny)
$(BUILD)/gpu/%: tests/gpu/%.c tests/gpu/bench_util.h $(LIBDFLASH) $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -Itests $< $(LIBDFLASH) $(CUDA_LIBS) $(LDLIBS) -o $@

$(BUILD)/emu/%.o: %
	@mkdir -p $(@D)
	$(CXX) -x c++ $(EMU_CXXFLAGS) -MMD -MP -c $< -o $@
$(BUILD)/emu/lib/ops.c.o: lib/ops.c $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -DDFLASH_HAVE_CUDA -MMD -MP -c $< -o $@
$(BUILD)/tests/test_ops_cuda_emu: tests/unit/test_ops_cuda.c tests/test.h tests/ops_agree.h tests/moe_oracle.h $(EMU_OBJ) $(LIB_OBJ)
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -Itests $< $(EMU_OBJ) $(filter-out $(BUILD)/lib/ops.o,$(LIB_OBJ)) -lstdc++ $(LDLIBS) -o $@

# the tools with the emulated CUDA backend: tests/cli/test_cuda_emu_model.sh
$(BUILD)/emu/bin/%: tools/%.c $(EMU_OBJ) $(LIB_OBJ)
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) $< $(EMU_OBJ) $(filter-out $(BUILD)/lib/ops.o,$(LIB_OBJ)) -lstdc++ $(LDLIBS) -o $@
$(EMU_BENCH): $(BUILD)/gpu/%_emu: tests/gpu/%.c tests/gpu/bench_util.h $(EMU_OBJ) $(LIB_OBJ)
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -Itests $< $(EMU_OBJ) $(filter-out $(BUILD)/lib/ops.o,$(LIB_OBJ)) -lstdc++ $(LDLIBS) -o $@
# the GPU run's wgmma layout probe against the emulation (its own main and
# g_cuda: no backend linked): tests/cli/test_gpu_bench.sh
$(BUILD)/gpu/wgmma_probe_emu: $(BUILD)/emu/tests/gpu/wgmma_probe.cu.o $(BUILD)/emu/tests/emu/cuda_emu.cpp.o \
                              $(BUILD)/lib/common.o $(BUILD)/lib/dtype.o
	@mkdir -p $(@D)
	$(CXX) $^ -lm -o $@

# The syscall tracer of tests/cli/test_durability.sh, preloaded into the
# tools (not under SAN: ASan's runtime must come first among preloads).
SYNC_TRACE := $(if $(filter 1,$(SAN)),,$(BUILD)/tests/sync_trace.so)
$(BUILD)/tests/sync_trace.so: tests/shim/sync_trace.c $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -O2 -fPIC -shared $< -ldl -o $@

check-build: $(TOOLS) $(UNIT_BIN) $(HELPER_BIN) $(EMU_TEST) $(GPU_BIN) $(SYNC_TRACE)

# The tests of one build tree (BUILD/BIN); prints its own tally.
test: check-build
	@DFLASH_BIN=$(abspath $(BIN)) DFLASH_BUILD=$(abspath $(BUILD)) tests/run.sh

# Everything: the normal build, then the sanitizer build, one final tally.
check: deps
	@$(MAKE) --no-print-directory status
	@$(MAKE) --no-print-directory check-build
	@$(MAKE) --no-print-directory SAN=1 BUILD=build-asan BIN=build-asan/bin check-build
	@DFLASH_BIN=$(abspath $(BIN)) DFLASH_BUILD=$(abspath $(BUILD)) \
	 DFLASH_ASAN_BIN=$(abspath build-asan/bin) DFLASH_ASAN_BUILD=$(abspath build-asan) \
	 tests/run.sh --with-asan

deps:
	@build-aux/deps.sh

# Like check: packages first, then a fresh make (the flags are read at parse time).
demo: deps
	@$(MAKE) --no-print-directory all $(BUILD)/tests/mktarget
	@DFLASH_BIN=$(abspath $(BIN)) DFLASH_BUILD=$(abspath $(BUILD)) pipelines/demo.sh

bench: deps
	@$(MAKE) --no-print-directory all $(HELPER_BIN)
	@DFLASH_BIN=$(abspath $(BIN)) DFLASH_BUILD=$(abspath $(BUILD)) tests/bench/run.sh

FUZZ_SRC := $(sort $(wildcard tests/fuzz/fuzz_*.c))
FUZZ_BIN := $(FUZZ_SRC:tests/fuzz/%.c=build-fuzz/%)
FUZZ_LIB_SRC := $(filter-out lib/ops_cpu%.c,$(LIB_SRC))

# The library goes into an archive, so a target links only what it uses
# (a reader's fuzz target does not need the op table's backends).
FUZZ_CFLAGS := -std=c11 -D_GNU_SOURCE -DFUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION -g -O1 \
  -fsanitize=address,undefined -fopenmp -Ilib $(PKG_CFLAGS)
build-fuzz/lib/%.o: lib/%.c
	@mkdir -p $(@D)
	clang $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -MMD -MP -c $< -o $@
build-fuzz/libdflash.a: $(FUZZ_LIB_SRC:%.c=build-fuzz/%.o)
	@rm -f $@
	ar rcs $@ $^
build-fuzz/%: tests/fuzz/%.c build-fuzz/libdflash.a
	@mkdir -p $(@D)
	clang $(FUZZ_CFLAGS) -fsanitize=fuzzer -MMD -MP -MF $@.d $< build-fuzz/libdflash.a $(PKG_LIBS) -lm -o $@

fuzz: $(FUZZ_BIN)
	@# New inputs go to build-fuzz/corpus/NAME; the committed seeds stay as they are.
	@for f in $(FUZZ_BIN); do n=$$(basename $$f); mkdir -p build-fuzz/corpus/$$n tests/fuzz/corpus/$$n; \
	  echo "fuzzing $$n for $(FUZZ_SECONDS)s"; \
	  $$f -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -malloc_limit_mb=1024 \
	    $$(test -f tests/fuzz/$$n.dict && echo -dict=tests/fuzz/$$n.dict) \
	    build-fuzz/corpus/$$n tests/fuzz/corpus/$$n || exit 1; done

fixtures:
	python3 tests/reference/make_fixtures.py

man: $(MAN_OUT)
man/%: man/%.scd man/gen.sh $(TOOLS)
	@BIN=$(BIN) man/gen.sh $< $@

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/man/man1 $(DESTDIR)$(PREFIX)/share/man/man5
	install -m 755 $(TOOLS) $(DESTDIR)$(PREFIX)/bin/
	install -m 644 $(wildcard man/*.1) $(DESTDIR)$(PREFIX)/share/man/man1/
	install -m 644 $(wildcard man/*.5) $(DESTDIR)$(PREFIX)/share/man/man5/

gpu-check:
	tests/gpu/run.sh

clean:
	rm -rf $(BUILD) build-asan build-fuzz $(BIN)

-include $(FUZZ_LIB_SRC:%.c=build-fuzz/%.d) $(FUZZ_BIN:=.d)
-include $(LIB_OBJ:.o=.d) $(KERNEL_OBJ:.o=.d) $(wildcard $(BUILD)/tools/*.d) $(wildcard $(BUILD)/tests/*.d) $(wildcard $(BUILD)/emu/*/*.d $(BUILD)/emu/*/*/*.d)
