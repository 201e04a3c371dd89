# llama3.cu: build the trainer, its tests and the CPU reference.
#
#   make                      CPU targets (reference, data tests) and, when nvcc is present, the CUDA trainer
#   make train_llama3cu       the CUDA trainer (PRECISION=BF16 default, PRECISION=FP32 for exact tie-out)
#   make test                 CPU tests always; GPU tests too when a GPU is present
#   make run                  the main job: tinyshakespeare shards, a small model from scratch, a loss plot
#
# Variables: PRECISION=BF16|FP32, GPU_COMPUTE_CAPABILITY (default: read from nvidia-smi, else 90), NO_OMP=1,
# LLAMA3_TOKENIZER / TINYSHAKESPEARE_TXT (paths to the tokenizer.model and the corpus, for `run` and `test`).

CXX ?= g++
NVCC ?= nvcc
PYTHON ?= python3
PRECISION ?= BF16

# nlohmann/json (read by llmc/hf_model.h): the Debian package nlohmann-json3-dev in /usr/include, or a copy in the
# ignored .deps/ that `make deps` makes from it, to carry to a machine without apt.
JSON_INCLUDE = $(if $(wildcard .deps/nlohmann/json.hpp),-isystem .deps,)

CXXFLAGS = -O2 -std=c++17 -Wall -Wextra -I. $(JSON_INCLUDE)
ifeq ($(NO_OMP),1)
  OMP_FLAGS = -Wno-unknown-pragmas
else
  OMP_FLAGS = -fopenmp
endif

ifeq ($(GPU_COMPUTE_CAPABILITY),)
  GPU_COMPUTE_CAPABILITY := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '.')
  ifeq ($(GPU_COMPUTE_CAPABILITY),)
    GPU_COMPUTE_CAPABILITY := 90
  endif
endif
# Hopper gets the arch-specific target (wgmma, TMA); other GPUs the plain one.
ifeq ($(GPU_COMPUTE_CAPABILITY),90)
  GENCODE = -gencode arch=compute_90a,code=sm_90a
else
  GENCODE = -gencode arch=compute_$(GPU_COMPUTE_CAPABILITY),code=sm_$(GPU_COMPUTE_CAPABILITY)
endif

ifeq ($(PRECISION),FP32)
  PRECISION_FLAGS = -DENABLE_FP32
else ifeq ($(PRECISION),BF16)
  PRECISION_FLAGS =
else
  $(error PRECISION must be BF16 or FP32, got '$(PRECISION)')
endif

NVCC_FLAGS = -O3 -std=c++17 -I. $(JSON_INCLUDE) $(GENCODE) $(PRECISION_FLAGS) --use_fast_math -Xcompiler -Wall \
             -Xcompiler $(OMP_FLAGS)
NVCC_LIBS = -lcublasLt -lcublas

HEADERS = $(wildcard llmc/*.h llmc/*.cuh)
CPU_TARGETS = dev/cpu/test_llama3_cpu dev/test/test_dataloader dev/test/test_tokenizer dev/test/test_hf_model
CUDA_TARGETS = train_llama3cu test_llama3cu

HAVE_NVCC := $(shell command -v $(NVCC) 2>/dev/null)
HAVE_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -c GPU)

.PHONY: all cpu cuda test run data clean deps

all: cpu $(if $(HAVE_NVCC),cuda,)

cpu: $(CPU_TARGETS)

cuda: $(CUDA_TARGETS)

dev/cpu/test_llama3_cpu: dev/cpu/test_llama3_cpu.cpp dev/cpu/llama3_cpu.h $(HEADERS)
	$(CXX) $(CXXFLAGS) $(OMP_FLAGS) $< -o $@

dev/test/%: dev/test/%.cpp $(HEADERS)
	$(CXX) $(CXXFLAGS) $(OMP_FLAGS) $< -o $@

# The precision is part of the binary: rebuild when PRECISION changes.
.precision_$(PRECISION):
	@rm -f .precision_*
	@touch $@

train_llama3cu: train_llama3.cu $(HEADERS) .precision_$(PRECISION)
	$(NVCC) $(NVCC_FLAGS) $< $(NVCC_LIBS) -o $@

test_llama3cu: test_llama3.cu train_llama3.cu $(HEADERS) .precision_$(PRECISION)
	$(NVCC) $(NVCC_FLAGS) $< $(NVCC_LIBS) -o $@

# CPU tests always; the GPU tests (dev/test/test_gpu.py) skip themselves when no GPU is present.
test: cpu
	$(PYTHON) -m pytest -q dev/test

DATA_DIR ?= data/tinyshakespeare
RUN_DIR ?= runs/tinyshakespeare_d6

data: $(DATA_DIR)/tiny_shakespeare_train.bin

$(DATA_DIR)/tiny_shakespeare_train.bin:
	$(PYTHON) dev/data/tinyshakespeare.py --out_dir $(DATA_DIR)
	$(PYTHON) dev/data/export_tokenizer.py --out $(DATA_DIR)/tokenizer.bin

# The main job: a d6 model from scratch on tinyshakespeare, with val loss, samples and a loss plot.
run: data train_llama3cu
	./train_llama3cu -c d6 -i "$(DATA_DIR)/tiny_shakespeare_train.bin" -j "$(DATA_DIR)/tiny_shakespeare_val.bin" \
	    -z $(DATA_DIR)/tokenizer.bin -o $(RUN_DIR) -b 16 -t 256 -x 300 -l 1e-3 -v 50 -s 100 -n 150
	$(PYTHON) scripts/plot_loss.py $(RUN_DIR)/log.txt $(RUN_DIR)/loss.png

deps:
	mkdir -p .deps && cp -r /usr/include/nlohmann .deps/
	cp /usr/share/doc/nlohmann-json3-dev/copyright .deps/nlohmann/LICENSE

clean:
	rm -f $(CPU_TARGETS) $(CUDA_TARGETS) .precision_*
