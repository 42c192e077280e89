package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import org.junit.jupiter.api.Test;

class SegmentCodecTest {
  private static final long ID = SegmentCodec.identity("spark-app-1-0", 42L, 3, 0);

  @Test
  void roundTripKeepsThePayload() throws Exception {
    byte[] payload = "rows of partition 3".getBytes(StandardCharsets.UTF_8);
    byte[] frame = SegmentCodec.encode(payload, ID);
    assertEquals(SegmentCodec.HEADER_BYTES + payload.length, frame.length);
    int length = SegmentCodec.verify(frame, ID, "seg");
    assertEquals(payload.length, length);
    assertArrayEquals(payload, Arrays.copyOfRange(frame, SegmentCodec.HEADER_BYTES,
        SegmentCodec.HEADER_BYTES + length));
  }

  @Test
  void emptyPayloadIsValid() throws Exception {
    assertEquals(0, SegmentCodec.verify(SegmentCodec.encode(new byte[0], ID), ID, "seg"));
  }

  @Test
  void aFlippedPayloadBitFailsTheChecksum() {
    byte[] frame = SegmentCodec.encode(new byte[1000], ID);
    frame[SegmentCodec.HEADER_BYTES + 500] ^= 0x10;
    var e = assertThrows(SegmentCodec.CorruptSegmentException.class,
        () -> SegmentCodec.verify(frame, ID, "segment 0 of block x"));
    assertTrue(e.getMessage().contains("checksum mismatch"), e.getMessage());
    assertTrue(e.getMessage().startsWith("segment 0 of block x"), e.getMessage());
  }

  @Test
  void truncatedAndForeignFramesAreRefused() {
    byte[] frame = SegmentCodec.encode(new byte[100], ID);
    var truncated = assertThrows(SegmentCodec.CorruptSegmentException.class,
        () -> SegmentCodec.verify(Arrays.copyOf(frame, frame.length - 1), ID, "s"));
    assertTrue(truncated.getMessage().contains("truncated"), truncated.getMessage());
    var tiny = assertThrows(SegmentCodec.CorruptSegmentException.class,
        () -> SegmentCodec.verify(new byte[3], ID, "s"));
    assertTrue(tiny.getMessage().contains("shorter than a segment header"));
    byte[] notOurs = frame.clone();
    notOurs[0] = 'X';
    assertTrue(assertThrows(SegmentCodec.CorruptSegmentException.class,
        () -> SegmentCodec.verify(notOurs, ID, "s")).getMessage().contains("magic"));
  }

  @Test
  void aSegmentOfAnotherBlockFailsItsIdentity() {
    byte[] frame = SegmentCodec.encode(new byte[10], ID);
    long otherAttempt = SegmentCodec.identity("spark-app-1-0", 43L, 3, 0);
    var e = assertThrows(SegmentCodec.CorruptSegmentException.class,
        () -> SegmentCodec.verify(frame, otherAttempt, "s"));
    assertTrue(e.getMessage().contains("identity mismatch"), e.getMessage());
  }

  @Test
  void identitiesDifferInEveryComponent() {
    long base = SegmentCodec.identity("spark-a-1", 7L, 2, 1);
    assertNotEquals(base, SegmentCodec.identity("spark-a-2", 7L, 2, 1));
    assertNotEquals(base, SegmentCodec.identity("spark-a-1", 8L, 2, 1));
    assertNotEquals(base, SegmentCodec.identity("spark-a-1", 7L, 3, 1));
    assertNotEquals(base, SegmentCodec.identity("spark-a-1", 7L, 2, 2));
    // Component boundaries are unambiguous: "a-1"/71 vs "a-17"/1.
    assertNotEquals(SegmentCodec.identity("a-1", 71L, 0, 0), SegmentCodec.identity("a-17", 1L, 0, 0));
  }
}
