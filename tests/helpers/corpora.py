"""Generated text for the tiny fixtures: mixed Chinese and English words, random or learnably repetitive."""

import random

ENGLISH = "the quick brown fox jumps over lazy dog model data train learn token block river mountain city".split()
CHINESE = ["我们", "今天", "学习", "模型", "数据", "训练", "中文", "词表", "扩展", "北京", "上海", "天气", "很好",
           "人民", "日报", "经济", "发展", "科学", "技术", "语言"]
NEW_WORDS = ["预训练", "低秩适配", "强化学习", "奖励模型"]


def generated_corpus(num_lines: int, seed: int) -> list:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(ENGLISH) if rng.random() < 0.5 else rng.choice(CHINESE) for _ in range(rng.randint(5, 14))]
        lines.append(" ".join(words))
    return lines


def repetitive_corpus(num_lines: int) -> list:
    """Text a model can learn within a few dozen steps: a few sentences, repeated."""
    sentences = [
        "the quick brown fox jumps over the lazy dog",
        "我们 今天 学习 中文 模型 训练",
        "one two three four five six seven eight",
        "北京 上海 天气 很好 人民 日报",
    ]
    return [sentences[i % len(sentences)] for i in range(num_lines)]


def write_lines(path, lines) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


# A well-formed preference pair: the good line beside a bad one in the refusal tests of the reward and DPO stages.
GOOD_PAIR = {"prompt": "写一条好评", "chosen": "很好 很好", "rejected": "不好"}


def marker_pairs(count, seed):
    """Chosen answers carry the marker word 好评; rejected ones do not: learnable from one token."""
    rng = random.Random(seed)
    words = ENGLISH + [w for w in CHINESE if w != "很好"]

    def sentence():
        return " ".join(rng.choice(words) for _ in range(rng.randint(4, 9)))

    pairs = []
    for _ in range(count):
        answer, other = sentence(), sentence()
        pairs.append({"prompt": sentence(), "chosen": f"{answer} 很好", "rejected": other})
    return pairs
