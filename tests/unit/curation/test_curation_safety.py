"""Safety: blocklists per language (word boundaries vs CJK substrings) and checksum-validated PII."""

from __future__ import annotations

import pytest

from llmpipe.curation.config import BlocklistSettings, PiiSettings
from llmpipe.curation.safety import BlocklistFilter, PiiRedactor, cn_id_valid, luhn_valid, redact_pii
from tests.fixtures.curation_docs import doc


@pytest.mark.parametrize("number", ["4111111111111111", "5500005555555559", "378282246310005", "79927398713"])
def test_luhn_positives(number: str) -> None:
    assert luhn_valid(number)


@pytest.mark.parametrize("number", ["4111111111111112", "1234567812345678", "79927398710", "12ab"])
def test_luhn_negatives(number: str) -> None:
    assert not luhn_valid(number)


@pytest.mark.parametrize("pid", ["11010519491231002X", "11010519491231002x"])
def test_cn_id_checksum(pid: str) -> None:
    # the GB 11643 standard's published example; the check character may be written lowercase
    assert cn_id_valid(pid)


@pytest.mark.parametrize("pid", ["110105194912310021", "11010519491331002X", "11010521991231002X", "1101051949123100"])
def test_cn_id_negatives(pid: str) -> None:  # bad check char, month 13, born in the future, too short
    assert not cn_id_valid(pid)


def test_redaction_placeholders_and_counts() -> None:
    text = ("Write to jane.roe+news@mail.example.org or call +44 20 7946 0958, (415) 555-2671 or 13812345678. "
            "Card 4111-1111-1111-1111, not 4111 1111 1111 1112. ID 11010519491231002X, not 110105194912310021. "
            "Hosts 10.0.0.254 and 2001:db8::8a2e:370:7334; version 1.2.3 at 12:30:45 on 2024-05-01.")
    out, counts = redact_pii(text)
    assert counts == {"email": 1, "phone": 3, "credit_card": 1, "cn_id": 1, "ip": 2}
    for placeholder in ("<EMAIL>", "<PHONE>", "<CREDIT_CARD>", "<CN_ID>", "<IP>"):
        assert placeholder in out
    for kept in ("4111 1111 1111 1112", "110105194912310021", "1.2.3", "12:30:45", "2024-05-01"):
        assert kept in out
    for gone in ("jane.roe", "7946", "13812345678", "10.0.0.254", "8a2e"):
        assert gone not in out


def test_redactor_only_selected_types() -> None:
    d = doc("mail a@b.co from 10.1.2.3")
    r = PiiRedactor(PiiSettings(types=["ip"]))
    assert r.filter(d) is True
    assert d.text == "mail a@b.co from <IP>" and d.metadata["pii"] == {"ip": 1} and r.stats == {"ip": 1}


def test_blocklist_word_boundaries_for_spaced_scripts() -> None:
    f = BlocklistFilter()
    assert f.filter(doc("What a load of shit, honestly.", lang="en")) == (False, "blocklist")
    assert f.filter(doc("The shitake mushrooms taste great.", lang="en")) is True  # no word-boundary hit
    assert f.filter(doc("Das ist Scheiße.", lang="de")) == (False, "blocklist")


def test_blocklist_substrings_for_cjk_and_user_lists(tmp_path) -> None:
    f = BlocklistFilter()
    assert f.filter(doc("这个网站有色情内容。", lang="zh")) == (False, "blocklist")
    assert f.filter(doc("今天天气很好。", lang="zh")) is True
    extra = tmp_path / "en-extra.txt"
    extra.write_text("# custom\nfoobarword\n")
    g = BlocklistFilter(BlocklistSettings(paths={"en": str(extra)}, max_hits=1))
    d = doc("foobarword once is allowed", lang="en")
    assert g.filter(d) is True and d.metadata["scores"]["blocklist"]["hits"] == 1
    assert g.filter(doc("foobarword foobarword twice", lang="en")) == (False, "blocklist")
    assert g.filter(doc("fuck fuck", lang="und")) == (False, "blocklist")  # untagged: default language


def test_blocklist_bad_config_is_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="safety.blocklist.languages"):
        BlocklistFilter(BlocklistSettings(languages=["xx"]))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        BlocklistFilter(BlocklistSettings(paths={"en": str(tmp_path / "missing.txt")}))
