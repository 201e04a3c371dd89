# llama3.cu: build the trainer, its tests and the CPU reference.
#
#   make                      CPU targets (reference, data tests) and, when nvcc is present, the CUDA trainer
#   make train_llama3cu       the CUDA trainer (PRECISION=BF16 default, PRECISION=FP32 for exact tie-out;
#                             USE_MPI=1 where MPI and NCCL are found: several GPUs with mpirun; USE_MPI=0 without)
#   make test                 CPU tests always; on a GPU machine also the GPU tie-outs, the resume tests, the dev/cuda
#                             kernel checks in both precisions and, with 2 GPUs and mpirun, the multi-GPU tests
#                             (built in temporary directories: the binaries here are left alone)
#   make run                  the main job (needs a GPU): tinyshakespeare shards, a small model from scratch, a loss plot
#   make finetune MODEL=path  fine-tune a model on the shipped chat set (dev/data/chat), val loss, a sample answer
#   make corpus               a real English corpus of ~11M tokens (the convergence test's data): the documentation
#                             sources of the Debian packages linux-doc, python3-doc and perl-doc (install them
#                             first: sudo apt-get install linux-doc python3-doc perl-doc), tokenized in parallel
#                             into CORPUS_DIR (default data/debian_docs) by dev/data/debian_docs.py
#   make dev/kernel_trace.so  a CUPTI tracer of the GPU timeline (dev/kernel_trace.cpp)
#
# Variables: PRECISION=BF16|FP32, GPU_COMPUTE_CAPABILITY (default: read from nvidia-smi, else 90), NO_OMP=1,
# LLAMA3_TOKENIZER / TINYSHAKESPEARE_TXT (another tokenizer.model or corpus than the repo's dev/data/llama3/tokenizer.model
# and dev/data/tinyshakespeare.txt), PYTHON (default: see dev/python_env.sh).

CXX ?= g++
NVCC ?= nvcc
PRECISION ?= BF16
# Python with the packages of dev/requirements.txt: python3 when it has them, else a .venv made and filled on first use
# (dev/python_env.sh). Evaluated only by the recipes that run Python.
PYTHON ?= $(or $(shell dev/python_env.sh),$(error could not set up Python, see the message above))
LLAMA3_TOKENIZER ?= dev/data/llama3/tokenizer.model

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

# Several GPUs: MPI launches the processes, NCCL does the collectives. USE_MPI=1 where both are found (OpenMPI's
# mpicc, or an MPI that pkg-config knows, and nccl.h under NCCL_HOME, the CUDA toolkit or /usr), USE_MPI=0 otherwise
# or when asked: the single-GPU trainer with neither dependency.
NVCC_BIN_DIR := $(dir $(shell command -v $(NVCC) 2>/dev/null))
CUDA_HOME ?= $(if $(NVCC_BIN_DIR),$(abspath $(NVCC_BIN_DIR)/..),/usr/local/cuda)
NCCL_HEADER := $(firstword $(wildcard $(if $(NCCL_HOME),$(NCCL_HOME)/include/nccl.h) $(CUDA_HOME)/include/nccl.h \
                 /usr/include/nccl.h /usr/local/include/nccl.h))
NCCL_DIR := $(patsubst %/include/,%,$(dir $(NCCL_HEADER)))
MPI_INCDIRS := $(shell mpicc --showme:incdirs 2>/dev/null || pkg-config --cflags-only-I mpi 2>/dev/null | sed 's/-I//g')
MPI_LIBDIRS := $(shell mpicc --showme:libdirs 2>/dev/null || pkg-config --libs-only-L mpi 2>/dev/null | sed 's/-L//g')
MPI_LIBS := $(shell mpicc --showme:libs 2>/dev/null || pkg-config --libs-only-l mpi 2>/dev/null | sed 's/-l//g')
ifeq ($(USE_MPI),)
  USE_MPI := $(if $(and $(NCCL_HEADER),$(MPI_LIBS)),1,0)
endif
ifeq ($(USE_MPI),1)
  ifeq ($(NCCL_HEADER),)
    $(error USE_MPI=1 but nccl.h was not found: set NCCL_HOME)
  endif
  ifeq ($(MPI_LIBS),)
    $(error USE_MPI=1 but no MPI was found (mpicc --showme or pkg-config mpi))
  endif
  MPI_FLAGS = -DUSE_MPI -I$(NCCL_DIR)/include $(addprefix -I,$(MPI_INCDIRS))
  MPI_LINK = -L$(NCCL_DIR)/lib -L$(NCCL_DIR)/lib64 $(addprefix -L,$(MPI_LIBDIRS)) -lnccl $(addprefix -l,$(MPI_LIBS)) \
             $(addprefix -Xlinker -rpath=,$(MPI_LIBDIRS))
endif

HEADERS = $(wildcard llmc/*.h llmc/*.cuh)
CPU_TARGETS = dev/cpu/test_llama3_cpu dev/test/test_dataloader dev/test/test_tokenizer dev/test/test_reliability \
              dev/test/test_hf_model dev/test/test_reshard
CUDA_TARGETS = train_llama3cu test_llama3cu

HAVE_NVCC := $(shell command -v $(NVCC) 2>/dev/null)
HAVE_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -c GPU)

.PHONY: all cpu cuda test run data corpus finetune clean deps cutlass require_gpu

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

# The MPI switch is part of the binary too.
.use_mpi_$(USE_MPI):
	@rm -f .use_mpi_*
	@touch $@

train_llama3cu: train_llama3.cu $(HEADERS) .precision_$(PRECISION) .use_mpi_$(USE_MPI)
	$(NVCC) $(NVCC_FLAGS) $(MPI_FLAGS) $< $(NVCC_LIBS) $(MPI_LINK) -o $@

test_llama3cu: test_llama3.cu train_llama3.cu $(HEADERS) .precision_$(PRECISION)
	$(NVCC) $(NVCC_FLAGS) $< $(NVCC_LIBS) -o $@

# The GPU timeline tracer (CUPTI, preloaded into any CUDA program; see the file's header).
dev/kernel_trace.so: dev/kernel_trace.cpp
	$(CXX) $(CXXFLAGS) -shared -fPIC -I$(CUDA_HOME)/include $< -o $@ -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/lib -lcupti \
	    -Wl,-rpath,$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib

# CPU tests always; the GPU tests (dev/test/*_gpu.py) skip themselves when no GPU is present. Where nvcc is, the
# trainer is built (as `make` would) for the flag and file checks of test_reliability.py; the GPU tests build their
# own binaries in temporary directories. -rs: the closing summary names every skipped test and why. The test files
# run in parallel (pytest-xdist, one file per worker, TEST_JOBS workers): on a GPU machine the suites take about a
# third of the time they take one after another.
TEST_JOBS ?= auto
test: cpu $(if $(HAVE_NVCC),cuda,)
	$(PYTHON) -m pytest -q -rs -n $(TEST_JOBS) --dist loadfile dev/test

DATA_DIR ?= data/tinyshakespeare
RUN_DIR ?= runs/tinyshakespeare_d6

data: $(DATA_DIR)/tiny_shakespeare_train.bin

$(DATA_DIR)/tiny_shakespeare_train.bin:
	$(PYTHON) dev/data/tinyshakespeare.py --out_dir $(DATA_DIR)
	$(PYTHON) dev/data/export_tokenizer.py --out $(DATA_DIR)/tokenizer.bin

# The Debian documentation corpus: train and val shards and the tokenizer, ready for train_llama3cu
# -i "$(CORPUS_DIR)/debian_docs_train_*.bin" -j "$(CORPUS_DIR)/debian_docs_val_*.bin" -z $(CORPUS_DIR)/tokenizer.bin.
# Nothing is installed here: a missing package stops the script with the apt-get command to run. `make -B corpus`
# remakes the shards (after a package upgrade, say).
CORPUS_DIR ?= data/debian_docs

corpus: $(CORPUS_DIR)/debian_docs_train_000000.bin

$(CORPUS_DIR)/debian_docs_train_000000.bin:
	$(PYTHON) dev/data/debian_docs.py --out_dir $(CORPUS_DIR)
	$(PYTHON) dev/data/export_tokenizer.py --out $(CORPUS_DIR)/tokenizer.bin

require_gpu:
	@command -v $(NVCC) >/dev/null || { echo "Error: $(NVCC) not found: make run needs the CUDA toolkit" >&2; exit 1; }
	@test "$(HAVE_GPU)" -gt 0 2>/dev/null || { echo "Error: no GPU found (nvidia-smi -L lists none): make run trains on a GPU" >&2; exit 1; }

# The main job: a d6 model from scratch on tinyshakespeare, with val loss, samples and a loss plot.
run: require_gpu data train_llama3cu
	./train_llama3cu -c d6 -i "$(DATA_DIR)/tiny_shakespeare_train.bin" -j "$(DATA_DIR)/tiny_shakespeare_val.bin" \
	    -z $(DATA_DIR)/tokenizer.bin -o $(RUN_DIR) -b 16 -t 256 -x 300 -l 1e-3 -v 50 -s 100 -n 150
	$(PYTHON) scripts/plot_loss.py $(RUN_DIR)/log.txt $(RUN_DIR)/loss.png

# Fine-tuning (SFT) on the chat set that ships in dev/data/chat: chat shards with a loss mask (only the assistant's
# tokens train), packed into rows of FT_T tokens; val loss before (step 0) and after; a sample answer to FT_PROMPT;
# the final model in FT_RUN_DIR/model_*.bin. MODEL is any checkpoint train_llama3cu -e reads. FT_EXPORT_FLAGS is the
# hook for the trainer's Hugging Face export flag (writing EXPORT_DIR at the end of the run).
FT_DATA_DIR ?= data/chat
FT_RUN_DIR ?= runs/finetune
FT_T ?= 512
FT_STEPS ?= 40
FT_FLAGS ?= -b 4 -l 2e-5 -u 4 -w 0 -v 10 -m -1
FT_PROMPT ?= What is 12 plus 30?
EXPORT_DIR ?= $(FT_RUN_DIR)/hf
FT_EXPORT_FLAGS ?= -X $(EXPORT_DIR)

finetune: train_llama3cu
	@test -n "$(MODEL)" || { echo "Error: make finetune needs MODEL=path (a checkpoint train_llama3cu -e reads)" >&2; exit 1; }
	$(PYTHON) dev/data/chat_to_shards.py --train dev/data/chat/chat_train.jsonl --val dev/data/chat/chat_val.jsonl \
	    --out_dir $(FT_DATA_DIR) --seq_len $(FT_T) --prompt "$(FT_PROMPT)"
	$(PYTHON) dev/data/export_tokenizer.py --out $(FT_DATA_DIR)/tokenizer.bin
	./train_llama3cu -e "$(MODEL)" -i "$(FT_DATA_DIR)/chat_train_*.bin" -j "$(FT_DATA_DIR)/chat_val_*.bin" \
	    -z $(FT_DATA_DIR)/tokenizer.bin -A $(FT_DATA_DIR)/chat_prompt.bin -o $(FT_RUN_DIR) -t $(FT_T) -x $(FT_STEPS) \
	    -s $(FT_STEPS) -n $(FT_STEPS) -L 64 $(FT_FLAGS) $(FT_EXPORT_FLAGS)
	@echo "val loss before and after:" && grep val_loss $(FT_RUN_DIR)/log.txt | sed -n '1p;$$p'
	$(PYTHON) scripts/plot_loss.py $(FT_RUN_DIR)/log.txt $(FT_RUN_DIR)/loss.png
	$(PYTHON) scripts/convert_hf.py tokenizer "$(LLAMA3_TOKENIZER)" $(EXPORT_DIR)

deps: cutlass
	mkdir -p .deps && cp -r /usr/include/nlohmann .deps/
	cp /usr/share/doc/nlohmann-json3-dev/copyright .deps/nlohmann/LICENSE

# CUTLASS headers for dev/cuda/matmul_cutlass.cu, from the nvidia-cutlass wheel on PyPI: only its C++ headers (and
# license) are used, so its Python dependencies are not installed.
CUTLASS_VERSION := 4.2.0.0
CUTLASS_HEADER := .deps/cutlass/cutlass_library/source/include/cutlass/cutlass.h
cutlass: $(CUTLASS_HEADER)
$(CUTLASS_HEADER):
	rm -rf .deps/cutlass && mkdir -p .deps/cutlass/wheel
	python3 -m pip download -q --no-deps nvidia-cutlass==$(CUTLASS_VERSION) -d .deps/cutlass/wheel
	python3 -c "import glob, zipfile; \
	    wheel = zipfile.ZipFile(glob.glob('.deps/cutlass/wheel/*.whl')[0]); \
	    keep = ('cutlass_library/source/include/', 'cutlass_library/source/tools/util/include/'); \
	    [wheel.extract(n, '.deps/cutlass') for n in wheel.namelist() if n.startswith(keep) or n.endswith('LICENSE.txt')]"
	rm -rf .deps/cutlass/wheel

clean:
	rm -f $(CPU_TARGETS) $(CUDA_TARGETS) .precision_* .use_mpi_*
